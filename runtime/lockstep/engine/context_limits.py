"""The context-length rule of a request, as stock SGLang applies it.

Why it exists: the reference engine used to cap `max_new_tokens` silently to what fit in its context.
Stock SGLang (without `--allow-auto-truncate`) refuses such a request with a 400 instead, so a long
agent session that worked against the reference engine failed against SGLang. The reference engine
now answers what SGLang answers (sglang/srt/managers/tokenizer_manager.py, `_validate_one_request`:
an input of the context length or more is refused; input + max_new_tokens beyond it is refused),
with SGLang's own messages; `--allow-auto-truncate` (SGLang's flag and spelling) restores the
truncation. The runtime never relies on either: its client asks only for what fits
(lockstep.serving.context_fit).

Who calls it: lockstep.engine.core (ReferenceEngine.new_sequence).
"""

from __future__ import annotations

from collections.abc import Sequence

from lockstep.engine.requests import EngineInputError


def fit_context(
    input_ids: Sequence[int], max_new_tokens: int, context_length: int, *, allow_auto_truncate: bool
) -> tuple[list[int], int]:
    """(input IDs, output budget) of a request under the context length; raises EngineInputError with
    SGLang's message when the request does not fit and truncation is not allowed.

    With allow_auto_truncate, as SGLang: an over-long input is cut to the context (here one token
    short of it, so the last prompt position still has a row of KV for its logits), then the budget
    to what is left."""
    ids = list(input_ids)
    n = len(ids)
    if n >= context_length:
        if not allow_auto_truncate:
            raise EngineInputError(
                f"The input ({n} tokens) is longer than the model's context length ({context_length} tokens)."
            )
        ids = ids[: context_length - 1]
        n = len(ids)
    if max_new_tokens + n > context_length:
        if not allow_auto_truncate:
            raise EngineInputError(
                "Requested token count exceeds the model's maximum context length "
                f"of {context_length} tokens. You requested a total of {max_new_tokens + n} "
                f"tokens: {n} tokens from the input messages and "
                f"{max_new_tokens} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )
        max_new_tokens = max(0, context_length - n)
    return ids, max_new_tokens
