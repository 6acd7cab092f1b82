"""HF <-> Megatron weight conversion: names, fused layouts and TP/EP/PP shards (pure tensor maps).

Why it exists: the checkpoint and the engines speak HF names (`model.layers.3.self_attn.q_proj.weight`),
megatron-core's GPTModel its own (`decoder.layers.3.self_attention.linear_qkv.weight`), with q/k/v and
gate/up fused and every big matrix split over tensor-parallel ranks. Everything here is a pure function
of tensors, so it is tested on the CPU (byte-identical round trips) and used unchanged on the GPU.

Three layouts, and the maps between them:

- HF: the checkpoint's tensors. Routed experts come in one of two spellings (`ExpertLayout`): the
  hub's per-expert tensors (`mlp.experts.<e>.gate_proj.weight` [I, H], `up_proj`, `down_proj` [H, I])
  or transformers >= 5's fused ones (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
  [E, H, I]), which is also what transformers' models (the reference engine, the FSDP backend) name
  their parameters.
- canonical: Megatron names with *global* layer and expert indices and the tensors a model without
  any parallelism holds. The conversion table (HF -> canonical):

      model.embed_tokens.weight                  embedding.word_embeddings.weight
      model.layers.L.input_layernorm.weight      decoder.layers.L.input_layernorm.weight
      model.layers.L.self_attn.{q,k,v}_proj      decoder.layers.L.self_attention.linear_qkv.weight
                                                   rows per KV group g: [q heads of g; k_g; v_g]
      model.layers.L.self_attn.o_proj.weight     decoder.layers.L.self_attention.linear_proj.weight
      model.layers.L.self_attn.{q,k}_norm        decoder.layers.L.self_attention.{q,k}_layernorm.weight
      model.layers.L.post_attention_layernorm    decoder.layers.L.pre_mlp_layernorm.weight
      model.layers.L.mlp.{gate,up}_proj          decoder.layers.L.mlp.linear_fc1.weight  [gate; up]
      model.layers.L.mlp.down_proj               decoder.layers.L.mlp.linear_fc2.weight
      model.layers.L.mlp.gate.weight             decoder.layers.L.mlp.router.weight
      expert e gate/up, down                     decoder.layers.L.mlp.experts.local_experts.e.linear_fc{1,2}.weight
      model.norm.weight                          decoder.final_layernorm.weight
      lm_head.weight (absent when tied)          output_layer.weight

- local: what one rank's GPTModel holds: the layers of its pipeline stage renumbered from 0, the
  experts of its EP rank renumbered from 0, and every TP-split tensor cut to its shard. Column-parallel
  tensors (embedding, output layer, qkv, fc1) split rows, row-parallel ones (linear_proj, fc2) split
  columns; a gated fc1 shard is [gate rows of the shard; up rows of the shard] (each rank applies
  SwiGLU to its own half-pair), so its gather de-interleaves. Experts split over ETP the same way.

Who calls it: lockstep.train.megatron.model (loading), .export (the weight-sync stream), tests.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lockstep.train.megatron.config import ExpertLayout

if TYPE_CHECKING:
    import torch

    from lockstep.train.megatron.config import ModelShape

NamedTensor = tuple[str, "torch.Tensor"]


def detect_expert_layout(names: Collection[str]) -> ExpertLayout:
    """The layout of a checkpoint's expert tensors (FUSED when it has no experts at all)."""
    return ExpertLayout.PER_EXPERT if any(_HF_PER_EXPERT_RE.search(n) for n in names) else ExpertLayout.FUSED


_HF_PER_EXPERT_RE = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


# ------------------------------------------------------------------------------------ HF -> canonical


def hf_to_canonical(
    shape: ModelShape, get: Callable[[str], torch.Tensor], names: Collection[str], layers: Sequence[int]
) -> Iterator[NamedTensor]:
    """Canonical tensors of `layers` (global indices), plus the embedding/final norm/output layer.

    `get(hf_name)` returns a full HF tensor (lazily read from the checkpoint); `names` are the
    checkpoint's tensor names (they decide the expert layout). The embedding and output layer are
    always yielded; the caller keeps what its pipeline stage holds.
    """
    import torch

    layout = detect_expert_layout(names)
    yield "embedding.word_embeddings.weight", get("model.embed_tokens.weight")
    for li in layers:
        hp, mp = f"model.layers.{li}.", f"decoder.layers.{li}."
        yield mp + "input_layernorm.weight", get(hp + "input_layernorm.weight")
        q, k, v = (get(f"{hp}self_attn.{x}_proj.weight") for x in "qkv")
        yield mp + "self_attention.linear_qkv.weight", fuse_qkv(shape, q, k, v)
        yield mp + "self_attention.linear_proj.weight", get(hp + "self_attn.o_proj.weight")
        yield mp + "self_attention.q_layernorm.weight", get(hp + "self_attn.q_norm.weight")
        yield mp + "self_attention.k_layernorm.weight", get(hp + "self_attn.k_norm.weight")
        yield mp + "pre_mlp_layernorm.weight", get(hp + "post_attention_layernorm.weight")
        if shape.is_moe and shape.moe_layers[li]:
            yield mp + "mlp.router.weight", get(hp + "mlp.gate.weight")
            yield from _hf_experts(shape, get, layout, li)
        else:
            gate, up = get(hp + "mlp.gate_proj.weight"), get(hp + "mlp.up_proj.weight")
            yield mp + "mlp.linear_fc1.weight", torch.cat([gate, up])
            yield mp + "mlp.linear_fc2.weight", get(hp + "mlp.down_proj.weight")
    yield "decoder.final_layernorm.weight", get("model.norm.weight")
    head = "model.embed_tokens.weight" if shape.tie_embeddings else "lm_head.weight"
    yield "output_layer.weight", get(head)


def _hf_experts(
    shape: ModelShape, get: Callable[[str], torch.Tensor], layout: ExpertLayout, li: int
) -> Iterator[NamedTensor]:
    import torch

    hp, mp = f"model.layers.{li}.mlp.experts.", f"decoder.layers.{li}.mlp.experts.local_experts."
    if layout is ExpertLayout.FUSED:
        gate_up, down = get(hp + "gate_up_proj"), get(hp + "down_proj")  # [E, 2I, H], [E, H, I]
        for e in range(shape.num_experts):
            yield f"{mp}{e}.linear_fc1.weight", gate_up[e]
            yield f"{mp}{e}.linear_fc2.weight", down[e]
        return
    for e in range(shape.num_experts):
        gate, up = get(f"{hp}{e}.gate_proj.weight"), get(f"{hp}{e}.up_proj.weight")
        yield f"{mp}{e}.linear_fc1.weight", torch.cat([gate, up])
        yield f"{mp}{e}.linear_fc2.weight", get(f"{hp}{e}.down_proj.weight")


def fuse_qkv(shape: ModelShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q [nq*d, H], k and v [nkv*d, H] -> Megatron linear_qkv [(nq + 2 nkv) * d, H], grouped per KV head."""
    import torch

    g, d, h = shape.num_kv_heads, shape.head_dim, q.shape[-1]
    qg = q.reshape(g, shape.q_per_group * d, h)
    return torch.cat([qg, k.reshape(g, d, h), v.reshape(g, d, h)], dim=1).reshape(-1, h)


def split_qkv(shape: ModelShape, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of fuse_qkv: Megatron linear_qkv -> HF (q, k, v), contiguous."""
    g, d = shape.num_kv_heads, shape.head_dim
    h = qkv.shape[-1]
    grouped = qkv.reshape(g, (shape.q_per_group + 2) * d, h)
    q, k, v = grouped.split([shape.q_per_group * d, d, d], dim=1)  # type: ignore[no-untyped-call]
    return q.reshape(-1, h).contiguous(), k.reshape(-1, h).contiguous(), v.reshape(-1, h).contiguous()


# ------------------------------------------------------------------------------------ canonical -> HF


def canonical_to_hf(shape: ModelShape, name: str, tensor: torch.Tensor) -> list[NamedTensor]:
    """One full canonical non-expert tensor -> its HF tensor(s); [] for a tied output layer."""
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", tensor)]
    if name == "output_layer.weight":
        return [] if shape.tie_embeddings else [("lm_head.weight", tensor)]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    m = _LAYER_RE.match(name)
    if m is None:
        raise KeyError(f"{name!r} is not a canonical Megatron tensor name of a Qwen3 model")
    hp, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = split_qkv(shape, tensor)
        return [
            (hp + "self_attn.q_proj.weight", q),
            (hp + "self_attn.k_proj.weight", k),
            (hp + "self_attn.v_proj.weight", v),
        ]
    if rest == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [
            (hp + "mlp.gate_proj.weight", gate.contiguous()),
            (hp + "mlp.up_proj.weight", up.contiguous()),
        ]
    simple = _SIMPLE_TO_HF.get(rest)
    if simple is None:
        raise KeyError(f"{name!r}: no HF counterpart (experts go through experts_to_hf)")
    return [(hp + simple, tensor)]


_SIMPLE_TO_HF = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}


def experts_to_hf(
    layer: int, kind: str, experts: Sequence[torch.Tensor], layout: ExpertLayout
) -> list[NamedTensor]:
    """Every expert's full canonical `kind` tensor (linear_fc1 / linear_fc2, expert order) of one layer -> HF."""
    import torch

    hp = f"model.layers.{layer}.mlp.experts."
    if layout is ExpertLayout.FUSED:
        fused = "gate_up_proj" if kind == "linear_fc1" else "down_proj"
        return [(hp + fused, torch.stack(list(experts)))]
    out: list[NamedTensor] = []
    for e, t in enumerate(experts):
        if kind == "linear_fc1":
            gate, up = t.chunk(2, dim=0)
            out += [
                (f"{hp}{e}.gate_proj.weight", gate.contiguous()),
                (f"{hp}{e}.up_proj.weight", up.contiguous()),
            ]
        else:
            out.append((f"{hp}{e}.down_proj.weight", t))
    return out


def canonical_model_to_hf(
    shape: ModelShape, canonical: dict[str, torch.Tensor], layout: ExpertLayout
) -> dict[str, torch.Tensor]:
    """A whole canonical state dict -> the HF state dict in `layout` (tests and single-process saves)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in canonical.items():
        key = expert_key(name)
        if key is None:
            out.update(canonical_to_hf(shape, name, t))
        else:
            layer, expert, kind = key
            experts.setdefault((layer, kind), {})[expert] = t
    for (layer, kind), by_e in sorted(experts.items()):
        out.update(experts_to_hf(layer, kind, [by_e[e] for e in sorted(by_e)], layout))
    return out


def expert_key(name: str) -> tuple[int, int, str] | None:
    """(layer, expert, linear_fc1|linear_fc2) of a (canonical or local) expert tensor name, else None."""
    m = _LAYER_RE.match(name)
    if m is None:
        return None
    e = _EXPERT_RE.match(m.group(2))
    return (int(m.group(1)), int(e.group(1)), e.group(2)) if e else None


# ------------------------------------------------------------------------------ shards and local names


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """Which part of the model one rank holds."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1


@dataclass(frozen=True, slots=True)
class Partition:
    """How a canonical tensor is split over a tensor-parallel group."""

    dim: int
    """Split dimension: 0 for column-parallel (rows), 1 for row-parallel (columns)."""
    gated: bool = False
    """A fused [gate; up] tensor: each shard is [gate part; up part]."""
    expert: bool = False
    """Split over the expert-tensor-parallel group (ETP) instead of TP."""


def partition(name: str) -> Partition | None:
    """How `name` is split over TP (or ETP for experts); None for a replicated tensor."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return Partition(0)
    m = _LAYER_RE.match(name)
    rest = m.group(2) if m else ""
    e = _EXPERT_RE.match(rest)
    if e:
        return (
            Partition(0, gated=True, expert=True) if e.group(2) == "linear_fc1" else Partition(1, expert=True)
        )
    return {
        "self_attention.linear_qkv.weight": Partition(0),
        "self_attention.linear_proj.weight": Partition(1),
        "mlp.linear_fc1.weight": Partition(0, gated=True),
        "mlp.linear_fc2.weight": Partition(1),
    }.get(rest)


def shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's shard of a canonical tensor (`rank`/`size` of the TP, or ETP for experts, group)."""
    part = partition(name)
    if part is None or size == 1:
        return full
    if part.gated:
        gate, up = full.chunk(2, dim=0)
        import torch

        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    return full.chunk(size, dim=part.dim)[rank].contiguous()


def unshard(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The inverse of `shard`: every rank's shard, in rank order -> the canonical tensor."""
    import torch

    part = partition(name)
    if part is None or len(shards) == 1:
        return shards[0]
    if part.gated:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(list(shards), dim=part.dim)


def stage_layers(shape: ModelShape, pp_rank: int, pp_size: int) -> range:
    """Global indices of the decoder layers of pipeline stage `pp_rank` (an even split)."""
    per = shape.num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def local_to_canonical_name(name: str, spec: ShardSpec, shape: ModelShape) -> str:
    """A local parameter name -> its canonical (global layer and expert) name."""
    m = _LAYER_RE.match(name)
    if m is None:
        return name
    layer = stage_layers(shape, spec.pp_rank, spec.pp_size)[int(m.group(1))]
    rest = m.group(2)
    e = _EXPERT_RE.match(rest)
    if e:
        expert = spec.ep_rank * (shape.num_experts // spec.ep_size) + int(e.group(1))
        rest = f"mlp.experts.local_experts.{expert}.{e.group(2)}.weight"
    return f"decoder.layers.{layer}.{rest}"


def holds(name: str, spec: ShardSpec, shape: ModelShape) -> bool:
    """True when this rank's model has (a shard of) canonical tensor `name`."""
    if name == "embedding.word_embeddings.weight":
        return spec.pp_rank == 0
    if name in ("decoder.final_layernorm.weight", "output_layer.weight"):
        # A tied output layer exists as its own tensor only on a last stage apart from the embedding.
        last = spec.pp_rank == spec.pp_size - 1
        return last and (name != "output_layer.weight" or not shape.tie_embeddings or spec.pp_size > 1)
    key = expert_key(name)
    if key is not None:
        per = shape.num_experts // spec.ep_size
        return key[1] // per == spec.ep_rank
    return True  # hf_to_canonical only yields the stage's layers


def canonical_to_local(
    shape: ModelShape, canonical: Iterator[NamedTensor], spec: ShardSpec
) -> dict[str, torch.Tensor]:
    """This rank's local state dict (local names, shards) from the canonical tensors of its stage."""
    layers = stage_layers(shape, spec.pp_rank, spec.pp_size)
    per = shape.num_experts // spec.ep_size if shape.is_moe else 0
    out: dict[str, torch.Tensor] = {}
    for name, full in canonical:
        if not holds(name, spec, shape):
            continue
        local = name
        m = _LAYER_RE.match(name)
        if m:
            rest = m.group(2)
            e = _EXPERT_RE.match(rest)
            if e:
                rest = f"mlp.experts.local_experts.{int(e.group(1)) - spec.ep_rank * per}.{e.group(2)}.weight"
            local = f"decoder.layers.{int(m.group(1)) - layers.start}.{rest}"
        part = partition(name)
        rank, size = (spec.etp_rank, spec.etp_size) if part and part.expert else (spec.tp_rank, spec.tp_size)
        out[local] = shard(name, full, rank, size).contiguous()
    return out
