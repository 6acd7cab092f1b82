"""The shared preparation pipeline of every weight transport: gather, convert, bucket (§7.2.1).

Why it exists: a weight update has two jobs, preparing serving-ready tensors from the trainer's sharded
layout and moving them. Preparing is the same for broadcast, CUDA IPC, disk-delta and P2P, so it is
done once here: gather a shard into the full tensor, convert trainer names and layout to HF/SGLang's
(for FSDP the identity, but fused expert tensors leave per expert), and fill size-bounded buckets in
which an atomic unit (a weight and its scale, a fused group) never straddles two buckets; routed
experts get their own buckets sized for the EP gather. docs/weights.md ("One pipeline, four transports") spells it out.

Who calls it: the transports (broadcast.py, ipc.py, p2p.py) and the disk-delta publisher; pure apart
from the gather hooks, golden-tested in runtime/tests/weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lockstep.weights import phases

if TYPE_CHECKING:
    import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
"""Nominal bucket size (§7.2.1: 512 MiB)."""

NamedTensor = tuple[str, "torch.Tensor"]
Converter = Callable[[str, "torch.Tensor"], list[NamedTensor]]
"""Per-family hook: one trainer (name, full tensor) -> zero or more (HF name, tensor) pairs."""
Gather = Callable[[str, "torch.Tensor"], "torch.Tensor"]
"""Per-tensor hook: a rank's shard -> the full tensor (TP all-gather, DTensor full_tensor)."""
ExpertGather = Callable[[list[NamedTensor]], list[NamedTensor]]
"""Per-bucket hook: this rank's local experts -> the experts of every EP rank (EP x as many)."""

# Suffixes of tensors that travel with their weight: FP8 block scales (`weight_scale_inv`), per-tensor
# scales (`weight_scale`, NVFP4's `weight_scale_2`, `input_scale`) and any other `*_scale` next to a `.weight`.
_SCALE_RE = re.compile(r"\.(weight_scale_inv|weight_scale_2|weight_scale|input_scale|[a-z_]*_scale)$")
_EXPERT_RE = re.compile(r"\.experts\.")
# Separate q/k/v (and gate/up) projections that SGLang stacks into one fused parameter.
_FUSED_RE = re.compile(r"\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.")


def scale_group_key(name: str) -> str:
    """Atomic-unit key: a scale tensor shares the key of its weight, everything else is its own unit."""
    m = _SCALE_RE.search(name)
    return name[: m.start()] + ".weight" if m else name


def fused_group_key(name: str) -> str:
    """Atomic-unit key for loaders that must see all parts of a fused parameter at once.

    `model.layers.3.self_attn.k_proj.weight` -> `model.layers.3.self_attn.qkv_proj` (and its scales);
    `model.layers.3.mlp.up_proj.weight` -> `model.layers.3.mlp.gate_up_proj`.
    """
    base = scale_group_key(name)
    m = _FUSED_RE.search(base)
    if m is None:
        return base
    fused = "self_attn.qkv_proj" if m.group(1).startswith("self_attn") else "mlp.gate_up_proj"
    return base[: m.start()] + "." + fused


def is_expert(name: str) -> bool:
    """Routed-expert tensors (`...mlp.experts.N...`) take the expert path of the pipeline."""
    return _EXPERT_RE.search(name) is not None


def identity_converter(name: str, tensor: torch.Tensor) -> list[NamedTensor]:
    """The identity: for backends whose converter already emits SGLang's names and layout."""
    return [(name, tensor)]


def hf_converter(name: str, tensor: torch.Tensor) -> list[NamedTensor]:
    """The converter for backends holding transformers' names and layout (FSDP2): the identity, but
    a fused 3-D expert tensor (`...mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I],
    transformers >= 5) leaves as its per-expert weights (`...mlp.experts.<e>.gate_proj.weight`,
    views), the names SGLang's MoE load_weights maps onto its FusedMoE (a fused name it drops)."""
    from lockstep.numerics import experts  # imports torch; the pipeline's planning stays torch-free

    x = experts.parse(name)
    if x is not None and x.expert is None and tensor.dim() == 3:
        return list(experts.split(name, tensor))
    return [(name, tensor)]


def gather_full(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Default gather: a DTensor (FSDP2 / TP shard) becomes its full tensor; a plain tensor is already full."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


@dataclass(slots=True)
class PipelineConfig:
    """How the pipeline buckets tensors; one per transport instance."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Flush when the next atomic unit would push the bucket past this many bytes (post-gather)."""
    expert_parallel: int = 1
    """EP size of the trainer: expert buckets flush at pre-gather bytes x expert_parallel."""
    group_key: Callable[[str], str] = scale_group_key
    """Maps an HF name to its atomic-unit key; consecutive tensors with one key share a bucket."""

    def __post_init__(self) -> None:
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {self.bucket_bytes}; the default is 512 MiB")
        if self.expert_parallel < 1:
            raise ValueError(f"expert_parallel must be >= 1, got {self.expert_parallel}")


@dataclass(slots=True)
class Bucket:
    """One flush of the pipeline: converted, full (post-gather) tensors handed to a transport."""

    index: int
    """0-based position in this update's bucket stream."""
    named_tensors: list[NamedTensor] = field(default_factory=list)
    """(HF name, full tensor) in pipeline order; atomic units are never split across buckets."""
    expert: bool = False
    """True for a routed-expert bucket (already EP-gathered)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named_tensors)

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.named_tensors]


def _nbytes(unit: list[NamedTensor]) -> int:
    return sum(t.numel() * t.element_size() for _, t in unit)


def atomic_units(
    named: Iterable[NamedTensor], group_key: Callable[[str], str]
) -> Iterator[list[NamedTensor]]:
    """Group consecutive tensors sharing a key into atomic units.

    A key that reappears after a different key is an error: the converter must emit the parts of a
    unit together, or a bucket boundary could fall between a weight and its scale.
    """
    done: set[str] = set()
    unit: list[NamedTensor] = []
    key: str | None = None
    for name, tensor in named:
        k = group_key(name)
        if k != key:
            if unit:
                yield unit
            if k in done:
                raise ValueError(
                    f"tensor {name!r} belongs to atomic unit {k!r}, which was already emitted: the "
                    "converter must emit a weight, its scales and the parts of a fused group together"
                )
            if key is not None:
                done.add(key)
            unit, key = [], k
        unit.append((name, tensor))
    if unit:
        yield unit


def bucket_units(units: Iterable[list[NamedTensor]], limit: int) -> Iterator[list[NamedTensor]]:
    """Pack atomic units into lists of at most `limit` bytes (a larger single unit travels alone)."""
    current: list[NamedTensor] = []
    size = 0
    for unit in units:
        n = _nbytes(unit)
        if current and size + n > limit:
            yield current
            current, size = [], 0
        current.extend(unit)
        size += n
    if current:
        yield current


def prepare_buckets(
    named_tensors: Iterable[NamedTensor],
    config: PipelineConfig | None = None,
    *,
    gather: Gather = gather_full,
    convert: Converter = hf_converter,
    expert_gather: ExpertGather | None = None,
) -> Iterator[Bucket]:
    """The whole pipeline: gather -> convert -> size-bounded buckets, dense first then experts.

    Dense tensors are gathered one at a time (a bucket never holds shards); routed experts are
    bucketed before their EP gather, with the flush threshold divided by EP, then `expert_gather`
    turns each pre-gather bucket into the full one. Expert buckets follow the dense ones because the
    experts of one EP rank are only complete after the collective.
    """
    cfg = config or PipelineConfig()
    experts: list[NamedTensor] = []

    def dense() -> Iterator[NamedTensor]:
        for name, shard in phases.timed(named_tensors, "gather"):  # the trainer's export gathers
            if is_expert(name):
                with phases.phase("convert"):
                    experts.extend(convert(name, shard))  # gathered per bucket below, not per tensor
                continue
            with phases.phase("gather"):
                full = gather(name, shard)
            with phases.phase("convert"):
                converted = convert(name, full)
            yield from converted

    index = 0
    for chunk in bucket_units(atomic_units(dense(), cfg.group_key), cfg.bucket_bytes):
        yield Bucket(index=index, named_tensors=chunk)
        index += 1
    pre_gather_limit = max(1, cfg.bucket_bytes // cfg.expert_parallel)
    for chunk in bucket_units(atomic_units(experts, cfg.group_key), pre_gather_limit):
        with phases.phase("gather"):
            full = expert_gather(chunk) if expert_gather is not None else chunk
        yield Bucket(index=index, named_tensors=full, expert=True)
        index += 1


def send_buckets(
    named_tensors: Iterable[NamedTensor], config: PipelineConfig | None, send: Callable[[Bucket], None]
) -> tuple[int, int]:
    """Prepare `named_tensors` and hand each bucket to `send` in order; (tensors, payload bytes) sent.

    The loop every bucket-at-a-time transport runs (broadcast, CUDA IPC) between pause and version bump.
    """
    tensors = payload = 0
    for bucket in phases.timed(prepare_buckets(named_tensors, config), "bucket"):
        send(bucket)
        tensors += len(bucket.named_tensors)
        payload += bucket.nbytes
    return tensors, payload
