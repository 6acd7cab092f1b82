"""Choose and build the trainer backend of an RLJob (trainer.backend: fsdp or megatron).

Why it exists: the two backends are swappable behind lockstep.train.backend.TrainBackend and never
import each other; the only place that knows both is this factory, so a call site (the local run, a
trainer rank) builds whichever the manifest names in one line. megatron-core is an optional extra
(`pip install lockstep[megatron]`): it is imported only when the job asks for it.

Who calls it: lockstep.trainer.local (the local trainer and the trainer ranks), lockstep.cli.trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.api import Device, Precision, TrainerBackend
from lockstep.api.profiles import trainer_kernels_for
from lockstep.numerics.recipe import training_recipe
from lockstep.train.fsdp import FSDPBackend, FSDPConfig

if TYPE_CHECKING:
    from lockstep.api import RLJob
    from lockstep.train.backend import TrainBackend


def build_backend(
    job: RLJob,
    model_dir: Path,
    *,
    lr: float,
    grad_clip: float,
    micro_batch_size: int,
    seed: int,
    embedded_engines: bool = False,
) -> TrainBackend:
    """The backend spec.trainer.backend names, for the checkpoint at `model_dir` (one rank of it).
    embedded_engines: the engines are the reference engines of this process (true on-policy then
    runs their kernels, lockstep.api.profiles.trainer_kernels_for)."""
    trainer = job.spec.trainer
    cuda = trainer.device is Device.CUDA
    common: dict[str, Any] = {
        "model_path": model_dir,
        "lr": lr,
        "grad_clip": grad_clip,
        "micro_batch_size": micro_batch_size,
        "seed": seed,
        "with_ref": job.spec.algorithm.kl.coef > 0,
    }
    if trainer.backend is TrainerBackend.MEGATRON:
        return _megatron(job, common)
    bf16 = cuda and trainer.precision is Precision.BF16
    return FSDPBackend(
        FSDPConfig(
            **common,
            device=str(trainer.device),
            dtype="bfloat16" if bf16 else "float32",
            offload=str(trainer.offload),
            true_on_policy=job.spec.algorithm.true_on_policy,
            kernels=trainer_kernels_for(job.spec, embedded_engines=embedded_engines) or "lockstep",
            train_recipe=training_recipe(job),
        )
    )


def _megatron(job: RLJob, common: dict[str, Any]) -> TrainBackend:
    trainer = job.spec.trainer  # bf16 only: rule megatron-trains-bf16 refuses the rest at apply
    try:
        from lockstep.train.megatron import MegatronBackend, MegatronConfig, ParallelLayout
    except ImportError as e:  # the optional extra is not installed
        raise ValueError(
            f"spec.trainer.backend megatron needs megatron-core ({e}): install lockstep[megatron], or set "
            "trainer.backend to fsdp"
        ) from e
    p = trainer.parallelism
    return MegatronBackend(
        MegatronConfig(
            **common,
            dtype="bfloat16",
            parallelism=ParallelLayout(p.tensor, p.pipeline, p.context, p.expert, p.expert_tensor),
            offload=str(trainer.offload),
            stream_optimizer_state=trainer.stream_optimizer_state_to_disk,
            export_bucket_bytes=job.spec.weight_sync.bucket_mib << 20,
        )
    )
