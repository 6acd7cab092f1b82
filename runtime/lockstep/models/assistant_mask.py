"""The loss mask of supervised fine-tuning: assistant tokens only, found with the checkpoint's own chat template.

Why it exists: an SFT job (docs/distillation.md) trains on what the model would write, the assistant turns of
a conversation, and on nothing else (system and user text, the template's role headers). The mask comes
from the same chat template that renders the prompts (lockstep.models.tokenizer), not from a second,
hand-written notion of where a turn starts: for each assistant message i, the template's render of the
conversation before it with the generation prompt (`messages[:i]`, add_generation_prompt) must be a
prefix of its render with it (`messages[:i+1]`); the tokens in between are that turn, and the mask is 1
on them up to and including the first end-of-turn token (generation_config's eos: what the model samples
to stop). Whatever the template writes after it (Qwen3's newline after `<|im_end|>`) is the template's
seam, not the model's, and gets 0.

A conversation is one row when the template renders it append-only (each turn's context is a prefix of
the whole render). Some templates render earlier turns otherwise than the last one (Qwen3 writes the
empty `<think>` block only on the last assistant turn): the whole render then shows the model a context
it never sees at inference, so such a conversation becomes one row per assistant turn instead, each the
template's render of that turn in its own context (`conversation_rows`).

Who calls it: lockstep.driver.sft (every row of an SFT job); tests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lockstep.models.tokenizer import ChatTokenizer


def conversation_rows(
    tok: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[tuple[list[int], list[int]]]:
    """The training rows (IDs, loss mask) of a conversation: one when the template is append-only over
    it (`conversation_ids`), else one per assistant turn in its own context (see the module doc)."""
    try:
        return [conversation_ids(tok, messages, tools)]
    except NotAppendOnly:
        pass
    rows = []
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            rows.append(conversation_ids(tok, messages[: i + 1], tools, only_last=True))
    return rows


class NotAppendOnly(ValueError):
    """The template renders some assistant turn's context otherwise inside the whole conversation."""


def conversation_ids(
    tok: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    only_last: bool = False,
) -> tuple[list[int], list[int]]:
    """(token IDs of the whole conversation, loss mask): 1 on each assistant turn's tokens (with
    only_last: the last message's) up to and including its end-of-turn token, 0 elsewhere. ValueError
    when there is no assistant turn, NotAppendOnly when the template is not append-only at one."""
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if only_last:
        turns = turns[-1:] if turns and turns[-1] == len(messages) - 1 else []
    if not turns:
        raise ValueError("an SFT conversation needs at least one assistant message to train on")
    full = tok.render(messages, False, tools)
    mask = [0] * len(full)
    stops = set(tok.stop_token_ids)
    for i in turns:
        before = tok.render(messages[:i], True, tools)
        through = tok.render(messages[: i + 1], False, tools)
        if full[: len(before)] != before or full[: len(through)] != through or len(through) < len(before):
            raise NotAppendOnly(
                f"chat template of {tok.source}: the conversation's render changes assistant message {i} or "
                "its context (the template is not append-only there)"
            )
        span = through[len(before) :]
        end = next((k + 1 for k, t in enumerate(span) if t in stops), len(span))
        for k in range(len(before), len(before) + end):
            mask[k] = 1
    return full, mask
