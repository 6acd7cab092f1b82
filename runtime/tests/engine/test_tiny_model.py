"""The tiny model family: fixed token IDs, the chat format, deterministic built-in checkpoints."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from lockstep.models.tiny import (
    ASSISTANT_ID,
    EOS_ID,
    TinyTokenizer,
    materialize_builtin,
    resolve_checkpoint,
    tiny_config,
)


def test_ids_are_fixed_and_round_trip() -> None:
    tok = TinyTokenizer()
    # Golden: specials first, then digits, letters, space, newline, punctuation.
    assert tok.vocab[:8] == [
        "<|pad|>",
        "<|eos|>",
        "<|user|>",
        "<|assistant|>",
        "<|tool|>",
        "<|system|>",
        "0",
        "1",
    ]
    assert tok.encode("aZ {") == [16, 67, 68, 70] and tok.vocab_size == 91 <= tiny_config().vocab_size
    text = '<|tool|>{"name": "add", "arguments": {"a": 1}}<|eos|>'
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text.replace("<|tool|>", "").replace(
        "<|eos|>", ""
    )
    with pytest.raises(ValueError, match="'é'"):
        tok.encode("café")


def test_chat_format_golden() -> None:
    tok = TinyTokenizer()
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "t"},
    ]
    assert tok.decode(tok.render(msgs, add_generation_prompt=True)) == (
        "<|system|>s<|user|>u<|assistant|>a<|eos|><|tool|>t<|assistant|>"
    )
    # The assistant turn ends with the token the model samples, so a rendered history equals the sampled IDs.
    prompt = tok.render(msgs[:2], add_generation_prompt=True)
    assert tok.render(msgs[:3], add_generation_prompt=False) == [*prompt, *tok.encode("a"), EOS_ID]
    assert prompt[-1] == ASSISTANT_ID
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        tok.render([{"role": "robot", "content": "x"}], add_generation_prompt=False)


def test_builtin_checkpoints_are_deterministic(tmp_path: Path) -> None:
    a = materialize_builtin("builtin:tiny", tmp_path / "a", seed=3)
    b = materialize_builtin("tiny", tmp_path / "b", seed=3)
    c = materialize_builtin("tiny", tmp_path / "c", seed=4)

    def digest(d: Path) -> str:
        return hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()

    assert digest(a) == digest(b) != digest(c)
    assert {"config.json", "model.safetensors", "tiny_tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in a.iterdir()
    }
    assert TinyTokenizer.load(a).vocab == TinyTokenizer().vocab
    assert resolve_checkpoint("builtin:tiny", tmp_path / "cache", seed=3) == tmp_path / "cache" / "tiny-seed3"
    assert digest(tmp_path / "cache" / "tiny-seed3") == digest(a)
    with pytest.raises(ValueError, match="unknown built-in model"):
        materialize_builtin("builtin:huge", tmp_path / "x")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        resolve_checkpoint(str(tmp_path / "nowhere"))
