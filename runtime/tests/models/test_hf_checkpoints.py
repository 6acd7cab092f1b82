"""Real HF-layout checkpoints per family: the tokenizer and template are the checkpoint's, the engine
generates what transformers generates, and the fixture templates are the published ones.

Fixtures (runtime/tests/hf_checkpoints.py): sharded safetensors with an index, a byte-level BPE
tokenizer.json with the family's control tokens, the family's chat template, generation_config.json.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lockstep.engine import ReferenceEngine
from lockstep.models import ChatTokenizer
from lockstep.serving import SamplingParams

FAMILIES = ["qwen3", "qwen3-moe", "glm5"]
CHAT = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "What is 12 * 7?"},
]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_checkpoint_is_in_hf_layout_and_its_tokenizer_renders_its_template(
    name: str, hf_checkpoint: Callable[[str], Path]
) -> None:
    d = hf_checkpoint(name)
    files = {p.name for p in d.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"} <= files
    assert len([f for f in files if f.endswith(".safetensors")]) > 1  # sharded
    tok = ChatTokenizer.load(d)
    text = tok.render_text(CHAT, add_generation_prompt=True)
    ids = tok.render(CHAT, add_generation_prompt=True)
    assert tok.decode(ids) == text
    opener = "<|im_start|>assistant\n" if name.startswith("qwen3") else "<|assistant|><think>"
    assert text.endswith(opener)
    # Control tokens are single IDs, and the turn's stop tokens come from generation_config.json.
    stop = "<|im_end|>" if name.startswith("qwen3") else "<|observation|>"
    assert len(tok.encode(stop)) == 1 and tok.encode(stop)[0] in tok.stop_token_ids


def test_glm5_fixture_template_is_byte_identical_to_sglangs_port() -> None:
    """SGLang ships a Python port of GLM-5.3's chat template, byte-identical to the Jinja; ours must match."""
    oracle = pytest.importorskip("sglang.srt.parser.glm53_chat_template")
    from hf_checkpoints import GLM5_TEMPLATE
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = [
        {
            "type": "function",
            "function": {
                "name": "calc",
                "description": "evaluate an arithmetic expression",
                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
            },
        }
    ]
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expression": "12 * 7", "n": 3}}}
    conversations = [
        CHAT,
        [
            {"role": "user", "content": "What is 12 * 7?"},
            {"role": "assistant", "content": "", "reasoning_content": "multiply", "tool_calls": [call]},
            {"role": "tool", "content": "84"},
            {"role": "tool", "content": "85"},
            {"role": "assistant", "content": " The answer is 84. "},
            {"role": "user", "content": "thanks"},
            {"role": "assistant", "content": "<think>ok</think>bye"},
        ],
    ]
    for messages in conversations:
        for gen in (True, False):
            for with_tools in (None, tools):
                rendered, _ = render_jinja_template(
                    conversations=[messages],
                    tools=with_tools,
                    chat_template=GLM5_TEMPLATE,
                    add_generation_prompt=gen,
                )
                assert rendered[0] == oracle.render_glm53(
                    messages, tools=with_tools, add_generation_prompt=gen
                )


async def _engine_greedy(d: Path, prompt: list[int], n: int) -> list[int]:
    engine = ReferenceEngine.load(d, max_running_requests=2, context_length=128)
    await engine.start()
    try:
        seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
        out = await asyncio.wait_for(engine.submit(seq), 120)
    finally:
        await engine.close()
    return list(out.output_ids)


def transformers_greedy(d: Path, prompt: list[int], n: int) -> list[int]:
    """What transformers alone computes from checkpoint dir `d`: n greedy tokens (argmax of the
    model's own forward, no Lockstep code and no generation-time logit processors)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_engine_generates_the_greedy_tokens_of_transformers(
    name: str, hf_checkpoint: Callable[[str], Path]
) -> None:
    d = hf_checkpoint(name)
    prompt = ChatTokenizer.load(d).render(CHAT, add_generation_prompt=True)
    assert asyncio.run(_engine_greedy(d, prompt, 8)) == transformers_greedy(d, prompt, 8)


def test_chat_template_override_and_missing_template(
    tmp_path: Path, hf_checkpoint: Callable[[str], Path]
) -> None:
    d = hf_checkpoint("qwen3")
    custom = tmp_path / "plain.jinja"
    custom.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    tok = ChatTokenizer.load(d, chat_template=custom)  # spec.model.chatTemplate
    assert (
        tok.render_text(CHAT, add_generation_prompt=True)
        == "system: You are a calculator.\nuser: What is 12 * 7?\n"
    )
    with pytest.raises(FileNotFoundError, match=r"spec\.model\.chatTemplate"):
        ChatTokenizer.load(d, chat_template=tmp_path / "nope.jinja")
    bare = tmp_path / "no-template"
    bare.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).write_bytes((d / name).read_bytes())
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"no chat template.*spec\.model\.chatTemplate"):
        ChatTokenizer.load(bare)
    assert ChatTokenizer.load(bare, require_template=False).encode("hi") == tok.encode(
        "hi"
    )  # an engine decodes
