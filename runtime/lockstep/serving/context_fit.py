"""Asking an engine only for what fits in its context.

Why it exists: stock SGLang (without `--allow-auto-truncate`) answers 400 when input + max_new_tokens
exceeds the model's context, so a multi-turn session whose history grows toward the context fails
its last turns, although the engine could still have sampled a shorter reply. The runtime's client
therefore learns the engine's context once (GET /v1/models, `max_model_len`, SGLang's OpenAI-compatible
model card) and lowers each request's budget to what is left: a long session ends its last turn
with finish reason `length`, as a truncated sample, instead of failing. An input that fills the whole
context cannot be sent at all: ContextFull names both numbers.

Who calls it: lockstep.serving.client.EngineClient.generate (every rollout, session turn and eval).
"""

from __future__ import annotations

from collections.abc import Sequence

from lockstep.serving.payloads import SamplingParams


class ContextFull(ValueError):
    """The input leaves no room for a completion in the engine's context."""


def fit_request(
    input_ids: Sequence[int], params: SamplingParams, context_length: int | None
) -> SamplingParams:
    """`params` with max_new_tokens lowered so that input + output fits `context_length` (None: the
    engine did not say; unchanged). Raises ContextFull when the input alone fills the context."""
    if context_length is None:
        return params
    n = len(input_ids)
    room = context_length - n
    if room <= 0:
        raise ContextFull(
            f"input_ids has {n} tokens and the engine's context is {context_length} tokens: no room for a "
            "completion (shorten the conversation or serve a longer context)"
        )
    if params.max_new_tokens <= room:
        return params
    return params.model_copy(update={"max_new_tokens": room})
