"""The tiny model: fixed token IDs, the chat template, deterministic built-in checkpoints in HF layout."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from lockstep.models import ChatTokenizer, CheckpointError, resolve_checkpoint
from lockstep.models.tiny import ASSISTANT_ID, EOS_ID, chat_tokenizer, materialize_builtin, tiny_config


def test_ids_are_fixed_and_round_trip() -> None:
    tok = chat_tokenizer()
    # Golden: specials first, then digits, letters, space, newline, punctuation.
    assert tok.hf.convert_ids_to_tokens(list(range(8))) == [
        "<|pad|>",
        "<|eos|>",
        "<|user|>",
        "<|assistant|>",
        "<|tool|>",
        "<|system|>",
        "0",
        "1",
    ]
    assert tok.encode("aZ {") == [16, 67, 68, 70] and tok.vocab_size == 92 <= tiny_config().vocab_size
    text = '<|tool|>{"name": "add", "arguments": {"a": 1}}<|eos|>'
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text.replace("<|tool|>", "").replace(
        "<|eos|>", ""
    )
    with pytest.raises(ValueError, match="'é'"):
        tok.encode("café")


def test_chat_format_golden() -> None:
    tok = chat_tokenizer()
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
    with pytest.raises(ValueError, match=r"messages\[0\].role is robot"):
        tok.render([{"role": "robot", "content": "x"}], add_generation_prompt=False)


def test_builtin_checkpoints_are_deterministic(tmp_path: Path) -> None:
    a = materialize_builtin("builtin:tiny", tmp_path / "a", seed=3)
    b = materialize_builtin("tiny", tmp_path / "b", seed=3)
    c = materialize_builtin("tiny", tmp_path / "c", seed=4)

    def digest(d: Path) -> str:
        return hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()

    assert digest(a) == digest(b) != digest(c)
    files = {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    assert files <= {p.name for p in a.iterdir()}
    loaded, built = ChatTokenizer.load(a), chat_tokenizer()
    assert loaded.hf.get_vocab() == built.hf.get_vocab() and loaded.chat_template == built.chat_template
    assert loaded.stop_token_ids == built.stop_token_ids == (EOS_ID,)
    assert resolve_checkpoint("builtin:tiny", tmp_path / "cache", seed=3) == tmp_path / "cache" / "tiny-seed3"
    assert digest(tmp_path / "cache" / "tiny-seed3") == digest(a)
    with pytest.raises(ValueError, match="unknown built-in model"):
        materialize_builtin("builtin:huge", tmp_path / "x")
    deep = materialize_builtin("builtin:tiny-deep", tmp_path / "deep", seed=3)
    assert json.loads((deep / "config.json").read_text())["num_hidden_layers"] == 3
    assert json.loads((a / "config.json").read_text())["num_hidden_layers"] == 2
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        resolve_checkpoint(str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match="no such directory, and not a Hugging Face repo id"):
        resolve_checkpoint(str(tmp_path / "nowhere"))
