"""The tiny model family: a Qwen3-architecture model, a character tokenizer and a chat format, all offline.

Why it exists: `lockstep run` on a laptop and every CPU test need a real causal LM with real weights,
a tokenizer and a chat template without downloading anything. The model is transformers'
`Qwen3ForCausalLM` built from a small `Qwen3Config`, so the trainer and the engine load it through
the same HF-layout checkpoint code as a real Qwen3 (safetensors + config.json, HF parameter names).

Built-in checkpoints (the strings manifests and the CLI accept as a model path):
- `builtin:tiny`   -- `tiny_config()`: vocab 96, hidden 64, 2 layers, tied embeddings (~0.1M params).
- `builtin:bigger` -- `bigger_config()`: Qwen3-0.6B-shaped (hidden 1024, 28 layers, vocab 151936,
  ~0.6B params), random-init, for GPU benchmarks only.
- `builtin:tiny-moe` -- `tiny_moe_config()`: Qwen3-MoE (2 layers of 8 experts, top-2), same tokenizer
  and chat format as tiny; for R3 routing replay (the section at the end of this module).
`materialize_builtin(name, dir, seed)` writes a deterministic random-init checkpoint dir for them.

Tokenizer: one token per character, IDs fixed forever (specials first, then the characters of
`CHARS` in order), so a checkpoint written today decodes the same tomorrow.

Chat format (the tiny family's template; the assistant turn ends with the sampled `<|eos|>`, so the
TITO session server needs no boundary repair for this family):
    [<|system|>text] then per message <|user|>text | <|assistant|>text<|eos|> | <|tool|>text,
    and the generation prompt <|assistant|>.

Who calls it: lockstep.engine (loads and decodes), lockstep.train (loads), lockstep.rollout and
lockstep.tasks (render prompts), the CLI (`--model builtin:tiny`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

PAD_ID = 0
EOS_ID = 1
USER_ID = 2
ASSISTANT_ID = 3
TOOL_ID = 4
SYSTEM_ID = 5

TOKENIZER_FILE = "tiny_tokenizer.json"
"""File name of the tokenizer inside a checkpoint dir."""
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""File name of the chat template (Jinja, the HF convention) inside a checkpoint dir."""

_ROLE_TOKEN = {"system": SYSTEM_ID, "user": USER_ID, "assistant": ASSISTANT_ID, "tool": TOOL_ID}

# Same rendering as TinyTokenizer.render, for HF tooling that reads chat_template.jinja.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|eos|>"
    "{% elif m['role'] == 'tool' %}<|tool|>{{ m['content'] }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class TinyTokenizer:
    """Character-level tokenizer of the tiny family with its chat format.

    encode/decode map text <-> IDs; special token strings in text (e.g. "<|eos|>") are recognised
    by `encode` so decode(encode(s)) == s for every encodable s.
    """

    __slots__ = ("_char_to_id", "_special_re", "vocab")

    def __init__(self) -> None:
        self.vocab: list[str] = [*SPECIAL_TOKENS, *CHARS]
        """Token strings by ID."""
        self._char_to_id = {c: i for i, c in enumerate(self.vocab)}
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def pad_token_id(self) -> int:
        return PAD_ID

    @property
    def eos_token_id(self) -> int:
        return EOS_ID

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(range(len(SPECIAL_TOKENS)))

    def encode(self, text: str) -> list[int]:
        """Text -> IDs; raises ValueError naming the first character outside the vocabulary."""
        ids: list[int] = []
        for part in self._special_re.split(text):
            if not part:
                continue
            special = self._char_to_id.get(part) if part in SPECIAL_TOKENS else None
            if special is not None:
                ids.append(special)
                continue
            for pos, ch in enumerate(part):
                tid = self._char_to_id.get(ch)
                if tid is None:
                    raise ValueError(
                        f"tiny tokenizer: character {ch!r} (in {part[max(0, pos - 10) : pos + 10]!r}) is not "
                        f"in the vocabulary; use only digits, ASCII letters, space, newline and {CHARS[64:]!r}"
                    )
                ids.append(tid)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """IDs -> text; IDs outside the vocabulary (a bigger model's) decode to nothing."""
        n = len(self.vocab)
        specials = len(SPECIAL_TOKENS)
        out = []
        for i in ids:
            if 0 <= i < n and not (skip_special_tokens and i < specials):
                out.append(self.vocab[i])
        return "".join(out)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> list[int]:
        """Chat messages ({"role", "content"}) -> prompt IDs in the tiny chat format.

        An assistant message is closed by <|eos|>, exactly the token the model samples to end its turn,
        so rendering a conversation reproduces the sampled tokens (no boundary repair for this family).
        """
        ids: list[int] = []
        for i, m in enumerate(messages):
            role = m.get("role")
            if role not in _ROLE_TOKEN:
                raise ValueError(f"messages[{i}].role is {role!r}; expected one of {sorted(_ROLE_TOKEN)}")
            if role == "system" and i != 0:
                raise ValueError(f"messages[{i}]: a system message is only allowed first")
            content = m.get("content") or ""
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content must be a string for the tiny family")
            ids.append(_ROLE_TOKEN[role])
            ids.extend(self.encode(content))
            if role == "assistant":
                ids.append(EOS_ID)
        if add_generation_prompt:
            ids.append(ASSISTANT_ID)
        return ids

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write tiny_tokenizer.json and chat_template.jinja into `directory`."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        spec = {"type": "lockstep-tiny-char", "special_tokens": list(SPECIAL_TOKENS), "chars": CHARS}
        (d / TOKENIZER_FILE).write_text(json.dumps(spec, indent=1) + "\n")
        (d / CHAT_TEMPLATE_FILE).write_text(CHAT_TEMPLATE + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> TinyTokenizer:
        """Read a tokenizer saved by `save`; raises if its vocabulary differs from this code's."""
        path = Path(directory) / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: this checkpoint dir has no tiny tokenizer")
        spec = json.loads(path.read_text())
        if spec.get("special_tokens") != list(SPECIAL_TOKENS) or spec.get("chars") != CHARS:
            raise ValueError(f"{path}: vocabulary differs from lockstep.models.tiny; IDs would not match")
        return cls()

    @staticmethod
    def exists_in(directory: str | os.PathLike[str]) -> bool:
        return (Path(directory) / TOKENIZER_FILE).is_file()


def tiny_config(**overrides: Any) -> Qwen3Config:
    """The tiny Qwen3 config (fp32, tied embeddings); keyword overrides replace any field."""
    from transformers import Qwen3Config

    fields: dict[str, Any] = {
        "vocab_size": 96,  # 91 used IDs rounded up to a multiple of 8
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
    fields.update(overrides)
    cfg = Qwen3Config(**fields)
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
    "bigger": "bigger_config(): Qwen3-0.6B-shaped random init; for GPU benchmarks",
    "tiny-moe": "tiny_moe_config(): Qwen3-MoE, vocab 96, hidden 64, 2 layers of 8 experts top-2; for R3",
}
"""Built-in checkpoint names (used as `builtin:<name>`) and what each is."""


def is_builtin(model: str) -> bool:
    """True when `model` names a built-in checkpoint (`builtin:<name>`)."""
    return model.startswith(BUILTIN_PREFIX)


def materialize_builtin(name: str, directory: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write a random-init HF-layout checkpoint of a built-in model into `directory`; returns it.

    Deterministic: the same name and seed give bit-identical safetensors. `name` may carry the
    `builtin:` prefix. The dir holds config.json, model.safetensors, tiny_tokenizer.json and
    chat_template.jinja.
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
        TinyTokenizer().save(d)
        return d
    # Init on CPU under a private generator so the weights do not depend on the caller's RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(tiny_config() if short == "tiny" else bigger_config())
    model.save_pretrained(d, safe_serialization=True)
    TinyTokenizer().save(d)
    return d


def resolve_checkpoint(model: str, cache_dir: str | os.PathLike[str] | None = None, seed: int = 0) -> Path:
    """Model path or `builtin:<name>` -> an HF-layout checkpoint dir (materialized once if built-in).

    Built-ins go to `cache_dir/<name>-seed<seed>` (default: $LOCKSTEP_CACHE or ~/.cache/lockstep);
    an existing complete dir is reused.
    """
    if not is_builtin(model):
        path = Path(model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model {model!r}: no config.json there; pass an HF-layout dir or builtin:tiny"
            )
        return path
    base = Path(cache_dir or os.environ.get("LOCKSTEP_CACHE") or Path.home() / ".cache" / "lockstep")
    target = base / f"{model.removeprefix(BUILTIN_PREFIX)}-seed{seed}"
    if (target / "model.safetensors").is_file() and TinyTokenizer.exists_in(target):
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    materialize_builtin(model, tmp, seed)
    if (target / "model.safetensors").is_file() and TinyTokenizer.exists_in(target):
        shutil.rmtree(tmp)  # another process finished first; its (identical) dir wins
        return target
    if target.exists():  # an incomplete dir left by an interrupted run
        shutil.rmtree(target)
    try:
        os.replace(tmp, target)  # atomic: concurrent readers see a complete dir or none
    except OSError:  # lost a race to a concurrent writer that just finished
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ------------------------------------------------------------------------------------- tiny-moe
# Why: R3 (rollout routing replay, seed §4.1) only means something on a mixture-of-experts
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
        "vocab_size": 96,  # the tiny tokenizer's 91 IDs rounded up to a multiple of 8
        "hidden_size": 64,
        "intermediate_size": 128,  # dense-MLP width, used only by layers listed in mlp_only_layers
        "moe_intermediate_size": 32,  # per-expert width
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,  # every layer is a MoE layer
        "mlp_only_layers": [],
        "output_router_logits": False,  # no auxiliary load-balancing loss in RL
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "pad_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
        "bos_token_id": None,
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
