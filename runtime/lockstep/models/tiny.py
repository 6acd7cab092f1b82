"""The tiny model family: a Qwen3-architecture model, a character tokenizer and a chat format, all offline.

Why it exists: `lockstep run` on a laptop and every CPU test need a real causal LM with real weights,
a tokenizer and a chat template without downloading anything. The model is transformers'
`Qwen3ForCausalLM` built from a small `Qwen3Config`, so the trainer and the engine load it through
the same HF-layout checkpoint code as a real Qwen3 (safetensors + config.json, HF parameter names).

Built-in checkpoints (the strings manifests and the CLI accept as a model path):
- `builtin:tiny`   -- `tiny_config()`: vocab 96, hidden 64, 2 layers, tied embeddings (~0.1M params).
- `builtin:tiny-deep` -- `tiny_config(num_hidden_layers=3)`: the same with a third layer (~0.15M params).
- `builtin:bigger` -- `bigger_config()`: Qwen3-0.6B-shaped (hidden 1024, 28 layers, vocab 151936,
  ~0.6B params), random-init, for GPU benchmarks only.
- `builtin:tiny-moe` -- `tiny_moe_config()`: Qwen3-MoE (2 layers of 8 experts, top-2), same tokenizer
  and chat format as tiny; for R3 routing replay (the section at the end of this module).
`materialize_builtin(name, dir, seed)` writes a deterministic random-init checkpoint dir for them.

Tokenizer: one token per character, IDs fixed forever (specials first, then the characters of
`CHARS` in order), so a checkpoint written today decodes the same tomorrow. It is saved like every HF
tokenizer (tokenizer.json from the `tokenizers` library, tokenizer_config.json with the chat template,
generation_config.json with the end-of-turn token), and the runtime reads it through the same
lockstep.models.tokenizer path as any real checkpoint's: there is no tiny-only code on the run path.

Chat format (the tiny family's template; the assistant turn ends with the sampled `<|eos|>`, so the
TITO session server needs no boundary repair for this family):
    [<|system|>text] then per message <|user|>text | <|assistant|>text<|eos|> | <|tool|>text,
    and the generation prompt <|assistant|>.

Who calls it: lockstep.engine (loads and decodes), lockstep.train (loads), lockstep.rollout and
lockstep.tasks (render prompts), the CLI (`--model builtin:tiny`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.models.tokenizer import ChatTokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import Qwen3Config, Qwen3MoeConfig

BUILTIN_PREFIX = "builtin:"
"""Prefix of a built-in checkpoint name (e.g. `builtin:tiny`)."""

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|eos|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|system|>",
)
"""Special tokens, IDs 0..5 in this order."""

CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n{}[]\":,.=+-*/?!()_'<>"
"""The ordinary characters, IDs 6.. in this order (enough to write tool calls in JSON)."""

UNK_TOKEN = "<|unk|>"
"""What a character outside CHARS encodes to (ID 91); ChatTokenizer.encode refuses it."""

PAD_ID = 0
EOS_ID = 1
USER_ID = 2
ASSISTANT_ID = 3
TOOL_ID = 4
SYSTEM_ID = 5

TOKENIZER_FILE = "tokenizer.json"
"""The tokenizer inside a checkpoint dir: a `tokenizers` tokenizer.json, as every HF checkpoint has."""

_ROLES = ("system", "user", "assistant", "tool")

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- set content = m['content'] if m['content'] is string else '' -%}"
    "{%- if m['role'] == 'system' -%}"
    "{%- if not loop.first -%}{{ raise_exception('messages[' ~ loop.index0 ~ ']: a system message is "
    "only allowed first') }}{%- endif -%}"
    "<|system|>{{ content }}"
    "{%- elif m['role'] == 'user' -%}<|user|>{{ content }}"
    "{%- elif m['role'] == 'assistant' -%}<|assistant|>{{ content }}"
    "{%- for c in m['tool_calls'] or [] -%}"
    "{%- set f = c['function'] if c['function'] is defined else c -%}"
    '<call>{"name":{{ f[\'name\'] | tojson }},"arguments":'
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}}</call>"
    "{%- endfor -%}"
    "<|eos|>"
    "{%- elif m['role'] == 'tool' -%}<|tool|>{{ content }}"
    "{%- else -%}{{ raise_exception('messages[' ~ loop.index0 ~ '].role is ' ~ m['role'] ~ '; expected "
    "one of assistant, system, tool, user') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
"""The tiny chat template (Jinja, in tokenizer_config.json): see the module doc for the format."""


def tiny_tokenizer() -> Tokenizer:
    """The tiny character tokenizer as a `tokenizers` Tokenizer (a BPE without merges).

    IDs: the SPECIAL_TOKENS 0..5, then CHARS in order, then UNK_TOKEN (91, inside the model's 96): a
    character outside CHARS becomes UNK_TOKEN, which ChatTokenizer.encode refuses, naming it.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {t: i for i, t in enumerate((*SPECIAL_TOKENS, *CHARS, UNK_TOKEN))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in (*SPECIAL_TOKENS, UNK_TOKEN)]
    )
    return tok


def save_tokenizer(directory: str | os.PathLike[str]) -> Path:
    """Write the tiny tokenizer in HF layout into `directory`: tokenizer.json, tokenizer_config.json
    (with the chat template) and generation_config.json (the end-of-turn token)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer().save(str(d / TOKENIZER_FILE))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "unk_token": UNK_TOKEN,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    generation = {"eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (d / "generation_config.json").write_text(json.dumps(generation, indent=1) + "\n")
    return d


@functools.cache
def chat_tokenizer() -> ChatTokenizer:
    """The tiny ChatTokenizer built in memory: exactly what ChatTokenizer.load reads back from a dir
    written by `save_tokenizer` (tests and benchmarks that need no checkpoint dir)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tiny_tokenizer(),
        eos_token=SPECIAL_TOKENS[EOS_ID],
        pad_token=SPECIAL_TOKENS[PAD_ID],
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    return ChatTokenizer(hf, CHAT_TEMPLATE, [EOS_ID], "builtin:tiny")


def has_tokenizer(directory: str | os.PathLike[str]) -> bool:
    """True when `directory` holds an HF tokenizer (tokenizer.json)."""
    return (Path(directory) / TOKENIZER_FILE).is_file()


TINY_FIELDS: dict[str, Any] = {
    "vocab_size": 96,  # the tiny tokenizer's 91 IDs rounded up to a multiple of 8
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "pad_token_id": PAD_ID,
    "eos_token_id": EOS_ID,
    "bos_token_id": None,
}
"""The tiny models' shared fields (dense and MoE): their tokenizer, width, heads and norms."""


def tiny_config(**overrides: Any) -> Qwen3Config:
    """The tiny Qwen3 config (fp32, tied embeddings); keyword overrides replace any field."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(**{**TINY_FIELDS, **overrides})
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def bigger_config(**overrides: Any) -> Qwen3Config:
    """A Qwen3-0.6B-shaped config (~0.6B params with tied embeddings) for GPU benchmarks."""
    fields: dict[str, Any] = {
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 4096,
    }
    fields.update(overrides)
    return tiny_config(**fields)


BUILTIN_SPECS: dict[str, str] = {
    "tiny": "tiny_config(): vocab 96, hidden 64, 2 layers, tied embeddings; for CPU runs and tests",
    "tiny-deep": "tiny_config(num_hidden_layers=3): builtin:tiny with a third layer; the reverse task's "
    "lookup of middle digits forms on more data seeds (bench/results/seed_sweep_2026-12-03_notes.md)",
    "bigger": "bigger_config(): Qwen3-0.6B-shaped random init; for GPU benchmarks",
    "tiny-moe": "tiny_moe_config(): Qwen3-MoE, vocab 96, hidden 64, 2 layers of 8 experts top-2; for R3",
}
"""Built-in checkpoint names (used as `builtin:<name>`) and what each is."""


_BUILTIN_CONFIGS: dict[str, Any] = {
    "tiny": tiny_config,
    "tiny-deep": lambda: tiny_config(num_hidden_layers=3),
    "bigger": bigger_config,
}
"""The dense built-ins' configs (tiny-moe is written by write_tiny_moe)."""


def is_builtin(model: str) -> bool:
    """True when `model` names a built-in checkpoint (`builtin:<name>`)."""
    return model.startswith(BUILTIN_PREFIX)


def materialize_builtin(name: str, directory: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write a random-init HF-layout checkpoint of a built-in model into `directory`; returns it.

    Deterministic: the same name and seed give bit-identical safetensors. `name` may carry the
    `builtin:` prefix. The dir is in HF layout: config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json (with the chat template) and generation_config.json.
    """
    import torch
    from transformers import Qwen3ForCausalLM

    short = name.removeprefix(BUILTIN_PREFIX)
    if short not in BUILTIN_SPECS:
        raise ValueError(f"unknown built-in model {name!r}; choose one of {sorted(BUILTIN_SPECS)}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if short == "tiny-moe":
        write_tiny_moe(d, seed)
        save_tokenizer(d)
        return d
    # Init on CPU under a private generator so the weights do not depend on the caller's RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(_BUILTIN_CONFIGS[short]())
    model.save_pretrained(d, safe_serialization=True)
    save_tokenizer(d)
    return d


def builtin_dir(model: str, cache_dir: str | os.PathLike[str] | None = None, seed: int = 0) -> Path:
    """`builtin:<name>` -> its checkpoint dir, materialized once into `cache_dir/<name>-seed<seed>`.

    Default cache: $LOCKSTEP_CACHE or ~/.cache/lockstep. An existing complete dir is reused; one written
    by an older Lockstep (no tokenizer.json) is replaced.
    """
    base = Path(cache_dir or os.environ.get("LOCKSTEP_CACHE") or Path.home() / ".cache" / "lockstep")
    target = base / f"{model.removeprefix(BUILTIN_PREFIX)}-seed{seed}"
    if _complete(target):
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    materialize_builtin(model, tmp, seed)
    if _complete(target):
        shutil.rmtree(tmp)  # another process finished first; its (identical) dir wins
        return target
    if target.exists():  # an incomplete dir left by an interrupted run, or an old layout
        shutil.rmtree(target)
    try:
        os.replace(tmp, target)  # atomic: concurrent readers see a complete dir or none
    except OSError:  # lost a race to a concurrent writer that just finished
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(d: Path) -> bool:
    return (
        (d / "model.safetensors").is_file() and (d / "tokenizer_config.json").is_file() and has_tokenizer(d)
    )


# ------------------------------------------------------------------------------------- tiny-moe
# Why: R3 (rollout routing replay, §4.1) only means something on a mixture-of-experts
# model, and every CPU test and a laptop `lockstep run` need one offline. It is transformers'
# `Qwen3MoeForCausalLM` built from a small `Qwen3MoeConfig`, so the engine and the trainer load it
# through the same HF-layout checkpoint code as a real Qwen3-MoE (Qwen3-30B-A3B and friends):
# every decoder layer's MLP is a sparse MoE block (router softmax over 8 experts, top-2, gate values
# renormalised over the chosen two because `norm_topk_prob` is true, as in the released Qwen3-MoE).
#
# Checkpoint layout: the safetensors file holds the parameters under the names the loaded model uses
# (`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I] per layer), the names
# the trainer exports and saves and the engine receives, so every weight path sees one set of names.
# (`save_pretrained` would write the hub's per-expert names, `mlp.experts.<e>.gate_proj.weight`;
# `from_pretrained` reads either.)


def tiny_moe_config(**overrides: Any) -> Qwen3MoeConfig:
    """The tiny Qwen3-MoE config (fp32, tied embeddings, 8 experts, top-2); overrides replace fields."""
    from transformers import Qwen3MoeConfig

    fields: dict[str, Any] = {
        **TINY_FIELDS,  # "intermediate_size" is the dense-MLP width, used only by mlp_only_layers
        "moe_intermediate_size": 32,  # per-expert width
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,  # every layer is a MoE layer
        "mlp_only_layers": [],
        "output_router_logits": False,  # no auxiliary load-balancing loss in RL
    }
    fields.update(overrides)
    cfg = Qwen3MoeConfig(**fields)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


def tiny_moe_model(**overrides: Any) -> Any:
    """A random-init `Qwen3MoeForCausalLM` of `tiny_moe_config(**overrides)` (the caller seeds torch)."""
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(tiny_moe_config(**overrides))


def write_tiny_moe(directory: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write config.json and model.safetensors of a deterministic random-init tiny MoE into `directory`.

    The same seed gives bit-identical weights (init under a private RNG). A tied lm_head is left out,
    as in HF checkpoints.
    """
    import torch
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tiny_moe_model()
    tied = bool(model.config.tie_word_embeddings)
    weights = {
        name: t.detach().contiguous()
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(d)
    return d
