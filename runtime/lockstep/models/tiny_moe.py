"""The tiny MoE model: a Qwen3-MoE-architecture model with the tiny family's tokenizer and chat format.

Why it exists: R3 (rollout routing replay, seed §4.1) only means something on a mixture-of-experts
model, and every CPU test and a laptop `lockstep run` need one offline. It is transformers'
`Qwen3MoeForCausalLM` built from a small `Qwen3MoeConfig`, so the engine and the trainer load it
through the same HF-layout checkpoint code as a real Qwen3-MoE (Qwen3-30B-A3B and friends):
every decoder layer's MLP is a sparse MoE block (router softmax over 8 experts, top-2, gate values
renormalised over the chosen two because `norm_topk_prob` is true, as in the released Qwen3-MoE).

Built-in name: `builtin:tiny-moe` (see lockstep.models.tiny.BUILTIN_SPECS); same tokenizer, chat
template and special-token IDs as `builtin:tiny`, so tasks and the session server work unchanged.

Checkpoint layout: the safetensors file holds the parameters under the names the loaded model uses
(`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I] per layer), the names
the trainer exports and saves and the engine receives, so every weight path sees one set of names.
(`save_pretrained` would write the hub's per-expert names, `mlp.experts.<e>.gate_proj.weight`;
`from_pretrained` reads either.)

Who calls it: lockstep.models.tiny.materialize_builtin (writes the checkpoint), tests.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.models.tiny import EOS_ID, PAD_ID

if TYPE_CHECKING:
    from transformers import Qwen3MoeConfig


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
