"""True on-policy mode: install the batch-invariant kernels into an HF causal LM, on both sides.

Why it exists: the trainer runs transformers' own forward (under FSDP2) and the reference engine runs
its own forward over the same modules (a KV cache, one decode token per sequence). For their
logprobs to be bit-identical every numerical step both take must be one function with one
reduction order (§4.3's kernel contract). `apply` swaps the leaf computations of the modules
for lockstep.numerics.kernels, in place, so both forwards run them without being rewritten:
- every nn.Linear (projections, MLP, lm_head) -> kernels.linear;
- every *RMSNorm -> kernels.rms_norm;
- the MLP activation (silu) -> kernels.silu;
- the rotary embedding -> kernels.rope;
- attention -> kernels.attention, registered with transformers as `lockstep_exact` (the trainer) and
  called directly by the engine's runner.
The logprob of a sampled token is kernels.token_logprobs on both sides. Matmuls run in float32 on
the tiles of `tiles_for(device)`; TF32 is switched off, since it is a process-wide setting that the
two sides could otherwise hold differently.

Scope: dense Qwen3 and the tiny family, and Qwen3-MoE-style MoE blocks (the tiny MoE): their router
(logits, softmax, top-k) and experts are rebuilt on the same kernels by
lockstep.numerics.experts.install_exact; other MoE blocks are refused. Registered profiles:
lockstep.api.profiles.
Who calls it: lockstep.train.fsdp (trainer), lockstep.engine (reference engine).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lockstep.numerics import experts, kernels
from lockstep.numerics.kernels import Tiles

ATTN_IMPLEMENTATION = "lockstep_exact"
"""The name our attention function is registered under in transformers."""

CPU_TILES = Tiles(rows=16, inner=64, cols=64, group=64)
"""Tiles on CPU: small, since every tile is one single-threaded matmul."""
CUDA_TILES = Tiles(rows=64, inner=256, cols=256, group=256)
"""Tiles on CUDA: big enough to keep the tensor-core-free fp32 matmuls busy."""

_TILES_ATTR = "_lockstep_tiles"
WEIGHT_VIEW_ATTR = "_lockstep_weight_view"
"""A Linear may carry a function of its weight to compute with instead (the recipe's fake quant)."""


def weight_of(linear: Any) -> torch.Tensor:
    """The weight a Linear computes with: its own, or its weight view's image of it."""
    view = getattr(linear, WEIGHT_VIEW_ATTR, None)
    w: torch.Tensor = linear.weight if view is None else view(linear.weight)
    return w


def tiles_for(device: torch.device | str) -> Tiles:
    """The tiles both sides use on `device` (fixed per device type, so two processes agree)."""
    return CUDA_TILES if torch.device(device).type == "cuda" else CPU_TILES


def tiles_of(model: Any) -> Tiles | None:
    """The tiles `apply` installed into `model`, or None when true on-policy is off for it."""
    tiles: Tiles | None = getattr(model, _TILES_ATTR, None)
    return tiles


def is_moe(model: Any) -> bool:
    """Whether any decoder layer has a sparse MoE block (a router `gate` and `experts`)."""
    return any(hasattr(m, "experts") and hasattr(m, "gate") for m in model.modules())


def apply(model: Any, device: torch.device | str) -> Tiles:
    """Install the batch-invariant kernels into `model` (in place); returns the tiles used.

    Raises NotImplementedError, naming the fix, for a model these kernels do not cover.
    """
    act = str(getattr(model.config, "hidden_act", "silu"))
    if act != "silu":
        raise NotImplementedError(f"hidden_act {act!r}: true on-policy kernels implement silu only")
    release_hub_kernels(model)
    tiles = tiles_for(device)
    if is_moe(model):  # router and experts on the same kernels (refuses the blocks it does not rebuild)
        experts.install_exact(
            model,
            linear=lambda x, w, b: kernels.linear(x, w, b, tiles),
            exp=lambda x: kernels.exp(x, tiles),
            rowsum=lambda x: kernels.rowsum(x, tiles),
            silu=lambda x: kernels.silu(x, tiles),
        )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for module in model.modules():
        _install(module, tiles)
    _register_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    setattr(model, _TILES_ATTR, tiles)
    return tiles


def release_hub_kernels(model: Any) -> None:
    """Turn off transformers' hub kernels on `model` (its torch forwards come back) before ours go in.

    transformers >= 5.25 kernelizes a model loaded with its default `use_kernels` and kernelizes it
    again on every `.train()` / `.eval()`, which overwrites the forwards installed here: the trainer's
    RMSNorm and SiLU silently went back to stock and the train-rollout diff was no longer 0.
    lockstep.models.loading loads with them off; this covers a model loaded any other way.
    """
    if getattr(model, "use_kernels", False):
        model.use_kernels = False


def _install(module: Any, tiles: Tiles) -> None:
    """Swap one module's leaf computation for its batch-invariant kernel (an instance attribute)."""
    name = type(module).__name__
    m: Any = module
    if isinstance(module, torch.nn.Linear):
        m.forward = lambda x: kernels.linear(x, weight_of(m), m.bias, tiles)
    elif name.endswith("RMSNorm"):
        m.forward = lambda x: kernels.rms_norm(x, m.weight, _eps(m), tiles)
    elif name.endswith("RotaryEmbedding"):

        def rotary(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # (Qwen3-MoE passes position_ids by keyword)
            cos, sin = kernels.rope(m.inv_freq, position_ids, float(m.attention_scaling), tiles)
            return cos.to(x.dtype), sin.to(x.dtype)

        m.forward = rotary
    elif hasattr(module, "act_fn") and hasattr(module, "gate_proj"):
        m.act_fn.forward = lambda x: kernels.silu(x, tiles)
    elif hasattr(module, "q_proj") and hasattr(module, "scaling"):
        setattr(module, _TILES_ATTR, tiles)


def _eps(norm: Any) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _exact_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over kernels.attention; returns [B, T, Hq, D]."""
    if dropout:
        raise ValueError("true on-policy attention has no dropout; set attention_dropout to 0")
    t, s = query.shape[-2], key.shape[-2]
    if attention_mask is None:  # causal by index: query i sits at position s - t + i
        rows = torch.arange(t, device=query.device)[:, None] + (s - t)
        visible = torch.arange(s, device=query.device)[None, :] <= rows  # [T, S]
    elif attention_mask.dtype == torch.bool:
        visible = attention_mask
    else:  # an additive float mask: 0 where visible
        visible = attention_mask == 0
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    tiles: Tiles = getattr(module, _TILES_ATTR)
    out = kernels.attention(query, key, value, visible, scale, tiles)  # [B, Hq, T, D]
    return out.transpose(1, 2).contiguous(), None


def install_attention(model: Any, device: torch.device | str) -> None:
    """Only the `lockstep_exact` attention (registered, with the device's tiles on every attention
    module): the batch-invariant stand-in where another attention kernel is not available."""
    tiles = tiles_for(device)
    for module in model.modules():
        if hasattr(module, "q_proj") and hasattr(module, "scaling"):
            setattr(module, _TILES_ATTR, tiles)
    _register_attention()


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _exact_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
