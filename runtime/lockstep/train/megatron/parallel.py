"""The Megatron backend's process groups: torch.distributed plus megatron-core's parallel state.

Why it exists: megatron-core keeps its TP/PP/EP/DP groups in a module-level parallel state that must
be initialised once per process, after the default process group. `init_parallel` does both (reusing a
parallel state of the same layout, refusing one of another), and `Groups` hands the backend the groups
and ranks it needs by name, so the rest of the package never reads the global state directly.

Data parallel here is what megatron-core computes: world / (TP x PP x CP); the experts' data-parallel
group is smaller by EP (experts are spread over the same GPUs, §9).

Who calls it: lockstep.train.megatron.backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lockstep.train.common.dist import DistInfo, init_distributed
from lockstep.train.megatron.config import ParallelLayout
from lockstep.train.megatron.convert import ShardSpec


@dataclass(frozen=True, slots=True)
class Groups:
    """This rank's place in every megatron-core group."""

    dist: DistInfo
    """Global rank, world size, local rank, and whether we created the default group."""
    spec: ShardSpec
    """Which shards of the model this rank holds."""
    dp_rank: int
    """Data-parallel rank (rows of the batch this rank trains)."""
    dp_size: int
    """Data-parallel size."""
    tp: Any
    """Tensor-parallel group."""
    pp: Any
    """Pipeline group (this rank's stage peers)."""
    dp: Any
    """Data-parallel group (dense parameters)."""
    ep: Any
    """Expert-parallel group."""
    etp: Any
    """Expert-tensor-parallel group."""
    owns_parallel_state: bool
    """True when this call initialised megatron-core's parallel state (destroy it on close)."""

    @property
    def first_stage(self) -> bool:
        return self.spec.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.spec.pp_rank == self.spec.pp_size - 1

    def pp_global_rank(self, stage: int) -> int:
        """Global rank of pipeline stage `stage` in this rank's pipeline group."""
        import torch.distributed as dist

        return int(dist.get_global_rank(self.pp, stage))


def init_parallel(layout: ParallelLayout, device_type: str = "cuda", seed: int = 0) -> Groups:
    """Initialise (or join) the default process group and megatron-core's parallel state for `layout`."""
    import torch
    from megatron.core import parallel_state as ps

    info = init_distributed(device_type)
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
    owns = not ps.model_parallel_is_initialized()
    if owns:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tensor,
            pipeline_model_parallel_size=layout.pipeline,
            context_parallel_size=layout.context,
            expert_model_parallel_size=layout.expert,
            expert_tensor_parallel_size=layout.expert_tensor,
            create_gloo_process_groups=False,
        )
    else:
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
        )
        if have != (layout.tensor, layout.pipeline, layout.expert):
            raise RuntimeError(
                f"megatron-core's parallel state is already set up as TP/PP/EP {have}; this backend wants "
                f"{(layout.tensor, layout.pipeline, layout.expert)}: one layout per process"
            )
    if device_type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    spec = ShardSpec(
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
    )
    return Groups(
        dist=info,
        spec=spec,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        dp=ps.get_data_parallel_group(),
        ep=ps.get_expert_model_parallel_group(),
        etp=ps.get_expert_tensor_parallel_group(),
        owns_parallel_state=owns,
    )


def destroy_parallel(groups: Groups) -> None:
    """Undo init_parallel for what it created (parallel state, then the default group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if groups.owns_parallel_state and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if groups.dist.owns_group and dist.is_initialized():
        dist.destroy_process_group()
