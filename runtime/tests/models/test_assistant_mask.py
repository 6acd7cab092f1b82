"""The SFT loss mask from the checkpoint's own chat template: assistant tokens only, end-of-turn included.

On the tiny template and on Qwen3's published template (the fixture checkpoint of tests/hf_checkpoints):
the masked tokens decode to exactly the assistant contents plus each turn's end-of-turn token; nothing of
the system or user text, the role headers or the template's seam after the end token is trained.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from lockstep.models import ChatTokenizer
from lockstep.models.assistant_mask import conversation_ids, conversation_rows
from lockstep.models.tiny import chat_tokenizer

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "rev 123"},
    {"role": "assistant", "content": "321"},
    {"role": "user", "content": "rev 45"},
    {"role": "assistant", "content": "54"},
]


def _spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    spans: list[list[int]] = []
    for i, (t, m) in enumerate(zip(ids, mask, strict=True)):
        if m and (i == 0 or not mask[i - 1]):
            spans.append([])
        if m:
            spans[-1].append(t)
    return spans


@pytest.mark.parametrize("family", ["tiny", "qwen3"])
def test_the_mask_covers_each_assistant_turn_and_its_end_token(
    family: str, hf_checkpoint: Callable[[str], Path]
) -> None:
    tok = chat_tokenizer() if family == "tiny" else ChatTokenizer.load(hf_checkpoint("qwen3"))
    rows = conversation_rows(tok, CHAT)
    if family == "tiny":  # append-only: the conversation is one row
        [(ids, mask)] = rows
        assert ids == tok.render(CHAT, False)
        spans = _spans(ids, mask)
    else:  # Qwen3 renders the last turn's empty <think> only: one row per turn, each in its own context
        assert [ids for ids, _ in rows] == [tok.render(CHAT[:3], False), tok.render(CHAT, False)]
        spans = [s for ids, mask in rows for s in _spans(ids, mask)]
        assert tok.decode(spans[0], skip_special_tokens=False).startswith("<think>")
    assert len(spans) == 2
    for span, content in zip(spans, ["321", "54"], strict=True):
        assert span[-1] in tok.stop_token_ids  # the model learns to stop
        text = tok.decode(span[:-1], skip_special_tokens=False)
        assert text.strip() == content or text.endswith(content)  # Qwen3 writes an empty think block first
    trained = tok.decode([t for s in spans for t in s], skip_special_tokens=True)
    assert "rev" not in trained and "brief" not in trained


def test_a_prompt_and_response_row_trains_the_response_only() -> None:
    tok = chat_tokenizer()
    ids, mask = conversation_ids(
        tok, [{"role": "user", "content": "rev 987"}, {"role": "assistant", "content": "789"}]
    )
    prompt = tok.render([{"role": "user", "content": "rev 987"}], True)
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    assert ids[len(prompt) :] == [*tok.encode("789"), tok.eos_token_id] and all(mask[len(prompt) :])


def test_no_assistant_turn_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one assistant message"):
        conversation_ids(chat_tokenizer(), [{"role": "user", "content": "hi"}])
