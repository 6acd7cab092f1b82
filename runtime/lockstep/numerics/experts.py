"""Expert weights, per expert: the two layouts of one MoE layer's experts and the forward over them.

Why it exists: a MoE layer's expert weights have two layouts. On disk (HF hub checkpoints) and in
SGLang's loader they are 2-D weights per expert and projection, `<layer>.experts.<e>.gate_proj.weight`
[I, H], `up_proj` [I, H], `down_proj` [H, I]; SGLang's FusedMoE maps those names onto its fused
`w13_weight` / `w2_weight` (and `<name>_scale_inv`, `_scale`, `_scale_2`, `input_scale` onto the
`w13_`/`w2_` scale parameters of its fp8 / ModelOpt MoE methods). In the trainer and the reference
engine (transformers >= 5) they are one 3-D tensor per layer and projection, `<layer>.experts.gate_up_proj`
[E, 2I, H] (expert e's gate rows first, then its up rows) and `<layer>.experts.down_proj` [E, H, I].
Low precision quantizes per expert and projection (SGLang's scales are per expert), so every stage
needs the per-expert view of a fused tensor: `split` (the export and the conversion write SGLang's
names), `views` (the engine receives per-expert names into its fused parameters, in place), and
`install_forward` (a forward of the experts whose per-expert weights and inputs the recipe may pass
through the quantizer: the training forward and the engine's NVFP4 activations).

Who calls it: lockstep.numerics.recipe (all four stages), lockstep.engine.live_weights (load and receive).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

PER_EXPERT = re.compile(
    r"^(?P<layer>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
"""A per-expert 2-D weight (HF hub and SGLang names)."""
FUSED = re.compile(r"^(?P<layer>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
"""A fused 3-D expert tensor (transformers >= 5 names)."""
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class ExpertTensor:
    """What a expert tensor name says: its MoE layer, and expert and projection when per-expert."""

    layer: str
    """The MoE layer's experts module (`model.layers.3.mlp.experts`: SGLang's FusedMoE prefix)."""
    expert: int | None
    """Expert index of a per-expert weight; None for a fused tensor."""
    proj: str
    """gate_proj, up_proj, down_proj (per expert) or gate_up_proj, down_proj (fused)."""

    def dims(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """(I, H): the expert's intermediate and hidden sizes, from the tensor's shape (None when the
        shape is not an expert weight's)."""
        if self.expert is not None:
            if len(shape) != 2:
                return None
            return (shape[1], shape[0]) if self.proj == "down_proj" else (shape[0], shape[1])
        if len(shape) != 3:
            return None
        return (shape[2], shape[1]) if self.proj == "down_proj" else (shape[1] // 2, shape[2])


def parse(name: str) -> ExpertTensor | None:
    """The expert tensor `name` names, or None (dense weights, shared experts, routers)."""
    m = PER_EXPERT.match(name)
    if m:
        return ExpertTensor(m["layer"], int(m["e"]), m["proj"])
    m = FUSED.match(name)
    if m:
        return ExpertTensor(m["layer"], None, m["proj"])
    return None


def per_expert_name(layer: str, e: int, proj: str) -> str:
    return f"{layer}.{e}.{proj}.weight"


def split(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A fused expert tensor -> its per-expert 2-D weights (views, SGLang's names), in expert order
    and, per expert, gate before up."""
    for e in range(t.shape[0]):
        yield from split_one(name, t, e)


def split_one(name: str, t: torch.Tensor, e: int) -> list[tuple[str, torch.Tensor]]:
    """Expert e's per-expert weights in the fused expert tensor `t` (gate before up)."""
    x = parse(name)
    assert x is not None and x.expert is None, name
    if x.proj == "down_proj":
        return [(per_expert_name(x.layer, e, "down_proj"), t[e])]
    half = t.shape[1] // 2
    return [
        (per_expert_name(x.layer, e, "gate_proj"), t[e, :half]),
        (per_expert_name(x.layer, e, "up_proj"), t[e, half:]),
    ]


def views(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert name -> view of the fused tensor it lives in, for every fused expert tensor of
    `named` (the engine writes received per-expert weights through these, in place)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        x = parse(name)
        if x is not None and x.expert is None and t.dim() == 3:
            out.update(split(name, t.data))
    return out


# ------------------------------------------------------------------------------- the forward

WeightView = Callable[[torch.Tensor], torch.Tensor]
"""Per expert: its 2-D weight ([2I, H] gate+up, or [H, I] down) -> what it computes with."""
ActView = Callable[[torch.Tensor], torch.Tensor]
"""An expert projection's input [tokens, in] -> what it computes with."""


@dataclass(slots=True)
class ExpertsHooks:
    """What the experts forward passes its weights and inputs through (identity when None), and the
    kernels it computes with (torch's when None)."""

    gate_up: WeightView | None = None
    down: WeightView | None = None
    gate_up_input: ActView | None = None
    down_input: ActView | None = None
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """x [n, in], w [out, in] -> x w^T: the batch-invariant kernel under true on-policy."""
    act: Callable[[torch.Tensor], torch.Tensor] | None = None
    """The activation of the gate (the module's act_fn when None)."""


HOOKS_ATTR = "_lockstep_experts_hooks"


def install_forward(experts: Any, hooks: ExpertsHooks) -> None:
    """Make a transformers (>= 5) experts module (3-D `gate_up_proj`, `down_proj`, `act_fn`) compute
    through `hooks`; installing twice replaces the hooks. The computation is transformers' eager one
    (per hit expert: linear, chunk into gate and up, act(gate) * up, linear, times the gate value,
    index_add), in expert order, so with no hooks it gives transformers' eager result."""
    setattr(experts, HOOKS_ATTR, hooks)
    if "forward" in vars(experts):
        return
    experts.forward = lambda hidden, idx, weights: _forward(experts, hidden, idx, weights)


def _forward(
    m: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    hooks: ExpertsHooks = getattr(m, HOOKS_ATTR)
    out = torch.zeros_like(hidden)
    num_experts = int(m.gate_up_proj.shape[0])
    with torch.no_grad():
        hit = sorted({int(e) for e in top_k_index.flatten().tolist() if 0 <= int(e) < num_experts})
    for e in hit:
        pos, token = torch.where((top_k_index == e).T)  # [k, N]: slot-major, as transformers' eager loop
        x = hidden[token]
        w13 = m.gate_up_proj[e]
        w2 = m.down_proj[e]
        if hooks.gate_up is not None:
            w13 = hooks.gate_up(w13)
        if hooks.down is not None:
            w2 = hooks.down(w2)
        if hooks.gate_up_input is not None:
            x = hooks.gate_up_input(x)
        linear = hooks.linear or torch.nn.functional.linear
        gate, up = linear(x, w13).chunk(2, dim=-1)
        h = (hooks.act or m.act_fn)(gate) * up
        if hooks.down_input is not None:
            h = hooks.down_input(h)
        y = linear(h, w2) * top_k_weights[token, pos, None]
        # each token gets its experts' outputs added in expert order, whatever else the batch holds
        out.index_add_(0, token, y.to(out.dtype))
    return out


# ----------------------------------------------------------------------- true on-policy (MoE)

GATES_AT_ATTR = "_lockstep_gates_at"
"""A router may carry `gates_at(logits, ids) -> gate values`: the gate values its forward computes,
at given experts (R3 replay computes the replayed experts' gates with it)."""


def is_topk_softmax_router(router: Any) -> bool:
    """transformers' Qwen3-MoE router (softmax over the experts, top-k, optional renormalisation):
    the one the exact MoE path rebuilds (GLM's sigmoid / grouped routers are not)."""
    return type(router).__name__.endswith("TopKRouter") and hasattr(router, "norm_topk_prob")


def install_exact(model: Any, linear: Callable[..., torch.Tensor], exp: Callable[..., torch.Tensor],
                  rowsum: Callable[..., torch.Tensor], silu: Callable[..., torch.Tensor]) -> int:  # fmt: skip
    """True on-policy for MoE blocks (router + experts, transformers >= 5): every router computes
    its logits with the batch-invariant `linear`, its softmax with `exp` and `rowsum` (each row's
    value independent of the rows beside it), its top-k exactly; the experts run `_forward` on the
    same kernels. Each token's output is then a function of that token alone, so the engine's
    decode and the trainer's packed batch give the same bits (lockstep.numerics.exact calls this
    with its kernels). Returns the MoE blocks covered; raises NotImplementedError for a router or
    experts module this does not rebuild."""
    n = 0
    for module in model.modules():
        router, experts_module = getattr(module, "gate", None), getattr(module, "experts", None)
        if router is None or experts_module is None or not hasattr(router, "top_k"):
            continue
        if not is_topk_softmax_router(router) or not hasattr(experts_module, "gate_up_proj"):
            raise NotImplementedError(
                f"{type(module).__name__}: true on-policy covers Qwen3-MoE-style blocks (softmax top-k "
                f"router, fused experts); {type(router).__name__} is not one; set spec.algorithm.trueOnPolicy to false"
            )
        if any(hasattr(module, a) for a in ("shared_expert", "shared_experts")):
            raise NotImplementedError(
                f"{type(module).__name__}: true on-policy does not cover shared experts yet"
            )
        _install_exact_router(router, linear, exp, rowsum)
        hooks = getattr(experts_module, HOOKS_ATTR, None) or ExpertsHooks()
        hooks.linear = lambda x, w: linear(x, w, None)
        hooks.act = silu
        install_forward(experts_module, hooks)
        n += 1
    return n


def _install_exact_router(router: Any, linear: Callable[..., torch.Tensor], exp: Callable[..., torch.Tensor],
                          rowsum: Callable[..., torch.Tensor]) -> None:  # fmt: skip
    def probs_of(logits: torch.Tensor) -> torch.Tensor:
        z = logits.float()
        e = exp(z - z.amax(dim=-1, keepdim=True))
        return e / rowsum(e)

    def normalise(gates: torch.Tensor) -> torch.Tensor:
        return gates / rowsum(gates) if router.norm_topk_prob else gates

    def forward(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = hidden.reshape(-1, router.hidden_dim)
        logits = linear(h, router.weight, None)  # [N, E]
        top, ids = torch.topk(probs_of(logits), router.top_k, dim=-1)
        return logits, normalise(top).to(logits.dtype), ids

    def gates_at(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return normalise(probs_of(logits).gather(1, ids)).to(logits.dtype)

    router.forward = forward
    setattr(router, GATES_AT_ATTR, gates_at)
