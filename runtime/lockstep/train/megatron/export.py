"""The Megatron backend's live weights in HF names, through the shared weight-sync bucket pipeline.

Why it exists: a weight update needs full HF-layout tensors on rank 0 while each rank holds shards of
its pipeline stage. The preparation is lockstep.weights.pipeline's (§7.2.1), fed with this
backend's hooks:

1. the stream: every stage's parameters in canonical names (global layers and experts), in stage
   order; a pipeline stage's tensors are broadcast to its pipeline peers so every rank walks the same
   sequence of collectives;
2. gather: a TP (ETP for experts) all-gather rebuilds the canonical tensor (gated fc1 de-interleaved);
3. convert: canonical -> HF names (fused qkv split into q/k/v, fc1 into gate/up);
4. experts: bucketed *before* their EP all-gather at bucket bytes / EP (pre-gather bytes x EP), each
   atomic unit being all local experts of one (layer, fc1|fc2), so a unit is complete after the gather
   and becomes either the fused transformers tensor [E, ...] or per-expert hub tensors.

Memory: with PP > 1 every rank receives the other stages' shards one tensor at a time (routed experts
are held until the dense part is done, as the pipeline orders them); rank 0 is the one that pushes.

Who calls it: lockstep.train.megatron.backend (export_weights, checkpoint save).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lockstep.train.megatron.config import ExpertLayout
from lockstep.train.megatron.convert import (
    NamedTensor,
    canonical_to_hf,
    expert_key,
    experts_to_hf,
    local_to_canonical_name,
    partition,
    unshard,
)
from lockstep.weights.pipeline import PipelineConfig, prepare_buckets, scale_group_key

if TYPE_CHECKING:
    import torch

    from lockstep.train.megatron.config import ModelShape
    from lockstep.train.megatron.parallel import Groups

_EXPERT_UNIT_RE = re.compile(
    r"^(decoder\.layers\.\d+\.mlp\.experts)\.local_experts\.\d+\.(linear_fc[12])\.weight$"
)


def group_key(name: str) -> str:
    """Atomic units: all experts of one (layer, fc1|fc2) together; HF tensors with their scales."""
    m = _EXPERT_UNIT_RE.match(name)
    return f"{m.group(1)}.{m.group(2)}" if m else scale_group_key(name)


@dataclass(slots=True)
class MegatronExport:
    """One rank's view of the export (all ranks iterate it; rank 0's tensors are the update)."""

    model: Any
    """This rank's bare GPTModel (its stage, its shards)."""
    shape: ModelShape
    groups: Groups
    layout: ExpertLayout
    """How routed experts are named on the HF side (the engine's / checkpoint's spelling)."""
    bucket_bytes: int
    """The weight sync's nominal bucket size (spec.weightSync.bucketMiB)."""

    def __iter__(self) -> Iterator[NamedTensor]:
        config = PipelineConfig(
            bucket_bytes=self.bucket_bytes, expert_parallel=self.groups.spec.ep_size, group_key=group_key
        )
        for bucket in prepare_buckets(
            self._stream(),
            config,
            gather=self._gather,
            convert=self._convert,
            expert_gather=self._expert_gather,
        ):
            yield from bucket.named_tensors

    # -- the stream ------------------------------------------------------------------------------

    def _local(self) -> list[tuple[str, Any]]:
        """(canonical name, local parameter) of this rank, a tied output layer left out.

        Dense tensors keep the model's order; experts follow, ordered by (layer, fc1|fc2, expert) so
        that each atomic unit (all local experts of one layer and kind) is contiguous.
        """
        dense, experts = [], []
        for name, p in self.model.named_parameters():
            canonical = local_to_canonical_name(name, self.groups.spec, self.shape)
            if canonical == "output_layer.weight" and self.shape.tie_embeddings:
                continue
            key = expert_key(canonical)
            if key is None:
                dense.append((canonical, p))
            else:
                experts.append(((key[0], key[2], key[1]), (canonical, p)))
        return dense + [named for _, named in sorted(experts, key=lambda e: e[0])]

    def _stream(self) -> Iterator[NamedTensor]:
        import torch
        import torch.distributed as dist

        local = self._local()
        if self.groups.spec.pp_size == 1:
            for name, p in local:
                yield name, p.detach()
            return
        meta = [(n, tuple(p.shape), p.dtype) for n, p in local]
        stages: list[Any] = [None] * self.groups.spec.pp_size
        dist.all_gather_object(stages, meta, group=self.groups.pp)
        mine = dict(local)
        for stage, entries in enumerate(stages):
            src = self.groups.pp_global_rank(stage)
            for name, shape, dtype in entries:
                if stage == self.groups.spec.pp_rank:
                    t = mine[name].detach()
                else:
                    t = torch.empty(shape, dtype=dtype, device=torch.cuda.current_device())
                dist.broadcast(t, src=src, group=self.groups.pp)
                yield name, t

    # -- pipeline hooks --------------------------------------------------------------------------

    def _gather(self, name: str, shard: torch.Tensor) -> torch.Tensor:
        part = partition(name)
        group = self.groups.etp if part is not None and part.expert else self.groups.tp
        return _all_gather(name, shard, group) if part is not None else shard

    def _convert(self, name: str, tensor: torch.Tensor) -> list[NamedTensor]:
        if expert_key(name) is not None:
            return [(name, tensor)]  # experts convert after their EP gather (_expert_gather)
        return canonical_to_hf(self.shape, name, tensor)

    def _expert_gather(self, chunk: list[NamedTensor]) -> list[NamedTensor]:
        per = self.shape.num_experts // self.groups.spec.ep_size
        units: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        for name, shard in chunk:
            full = _all_gather(name, shard, self.groups.etp)
            key = expert_key(name)
            assert key is not None
            layer, expert, kind = key
            local = expert - self.groups.spec.ep_rank * per
            parts = [full] if self.groups.spec.ep_size == 1 else _gather_list(full, self.groups.ep)
            for r, t in enumerate(parts):
                units.setdefault((layer, kind), {})[r * per + local] = t
        out: list[NamedTensor] = []
        for (layer, kind), by_e in units.items():
            out += experts_to_hf(layer, kind, [by_e[e] for e in sorted(by_e)], self.layout)
        return out


def _gather_list(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _all_gather(name: str, shard: torch.Tensor, group: Any) -> torch.Tensor:
    """The canonical tensor from every rank's shard of `group` (no collective for a group of one)."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return shard
    return unshard(name, _gather_list(shard, group))
