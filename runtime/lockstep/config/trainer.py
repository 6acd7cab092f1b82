"""The trainer side's configs from an RLJob: TrainerConfig and what it holds (pure, golden-tested).

Why it exists: every manifest field the trainer process reads is read here, once: the trainer's knobs
(TrainerSettings), the backend's construction config (FSDPConfig or MegatronConfig), the weight
transport's (TransportConfig), the low-precision recipes. A trainer rank imports this module and not
lockstep.config.driver.

Who calls it: lockstep.config.driver (a local run's trainer), lockstep.cli.trainer (a trainer rank),
lockstep.cli.precision.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lockstep.api import Device, Engine, Offload, Precision, RLJob, TrainerBackend, TrainingRecipe
from lockstep.api.profiles import trainer_kernels_for
from lockstep.models import ModelSource
from lockstep.numerics.quant import Format, Scheme
from lockstep.numerics.recipe import Recipe
from lockstep.train.common.losses import PolicyLossConfig
from lockstep.train.common.lr_schedule import LRSchedule
from lockstep.train.common.mismatch import MismatchConfig
from lockstep.train.fsdp import FSDPConfig
from lockstep.train.fsdp.lora import AdapterConfig
from lockstep.train.megatron import MegatronConfig, ParallelLayout
from lockstep.trainer.settings import TrainerConfig, TrainerSettings
from lockstep.weights.factory import AdapterTransfer, TransportConfig

if TYPE_CHECKING:
    from lockstep.train.backend import BackendConfig


def trainer_config(job: RLJob, *, embedded_engines: bool = False) -> TrainerConfig:
    """The trainer process of `job`. embedded_engines: the rollout engines are the reference engines
    of this process (`lockstep run` without engine URLs), whatever spec.rollout.engine says."""
    spec = job.spec
    return TrainerConfig(
        job_name=job.metadata.name,
        model=model_source(job),
        data=spec.data,
        settings=trainer_settings(job),
        backend=backend_config(job, embedded_engines=embedded_engines),
        transport=transport_config(job),
        world_size=spec.trainer.nodes * spec.trainer.gpus_per_node,
    )


def model_source(job: RLJob) -> ModelSource:
    """Where the model comes from (spec.model.checkpoint, tokenizer, chatTemplate)."""
    model = job.spec.model
    return ModelSource(
        checkpoint=model.checkpoint, tokenizer=model.tokenizer, chat_template=model.chat_template
    )


def trainer_settings(job: RLJob) -> TrainerSettings:
    """The trainer's knobs (the API keeps the sampling temperature above 0). The seed, the learning
    rate, gradient clipping, the micro-batch, the temperature and the KL coefficient are read here
    only; the backend's config and the driver's RunSettings take them from these settings."""
    spec = job.spec
    alg = spec.algorithm
    groups, samples = batch_shape(job)
    return TrainerSettings(
        seed=spec.data.seed,
        learning_rate=alg.learning_rate,
        grad_clip=spec.trainer.grad_clip,
        micro_batch_size=spec.trainer.micro_batch_size,
        temperature=spec.rollout.sampling.temperature,
        sft_steps=alg.sft_warm_start.steps,
        sft_learning_rate=alg.sft_warm_start.learning_rate,
        sft_rows=groups * samples,
        sft_stop_at_loss=alg.sft_warm_start.stop_at_loss,
        loss=loss_config(job),
        lr_schedule=_lr_schedule(job, alg.learning_rate),
        check_weight_update_equal=spec.weight_sync.check_weight_update_equal,
        engine_checksums=spec.rollout.engine is Engine.REFERENCE,
        allow_quant_error=serving_recipe(job) is not None,  # the engines serve a low-precision recipe
        offload_between_steps=_offload(job) is not Offload.NONE,
        opd_coef=alg.opd.coef if alg.opd is not None else None,
        sft_job=sft_job(job),
    )


def sft_job(job: RLJob) -> bool:
    """spec.recipe is sft: supervised fine-tuning, with no engines and no rollout."""
    return job.spec.recipe is TrainingRecipe.SFT


def batch_shape(job: RLJob) -> tuple[int, int]:
    """(groups per step, samples per group): spec.algorithm.batchSize and samplesPerPrompt, read here for
    both sides (the trainer's SFT rows, the driver's Schedule)."""
    alg = job.spec.algorithm
    return alg.batch_size, alg.samples_per_prompt


def job_steps(job: RLJob) -> int:
    """spec.schedule.steps: the job's optimizer steps (the RL learning rate's schedule spans them; the
    driver's run reaches them)."""
    return job.spec.schedule.steps


def true_on_policy(job: RLJob) -> bool:
    """spec.algorithm.trueOnPolicy: batch-invariant kernels in the trainer (FSDP) and in every engine."""
    return job.spec.algorithm.true_on_policy


def _offload(job: RLJob) -> Offload:
    """spec.trainer.offload: the backend offloads there; the trainer offloads between steps unless none."""
    return job.spec.trainer.offload


def _trainer_device(job: RLJob) -> Device:
    """spec.trainer.device: where the backend trains and what the weight transport moves from."""
    return job.spec.trainer.device


def loss_config(job: RLJob) -> PolicyLossConfig:
    """The RL loss settings of the manifest (spec.algorithm)."""
    alg = job.spec.algorithm
    return PolicyLossConfig(
        estimator=alg.advantage_estimator,  # StrEnums: the loss compares them with its str names
        eps_clip_low=alg.eps_clip,
        eps_clip_high=alg.eps_clip_high if alg.eps_clip_high is not None else alg.eps_clip,
        kl_coef=alg.kl.coef,
        kl_estimator=alg.kl.estimator,
        mismatch=MismatchConfig(alg.mismatch.correction, alg.mismatch.low, alg.mismatch.high),
    )


def _lr_schedule(job: RLJob, learning_rate: float) -> LRSchedule:
    """The RL learning-rate schedule of the manifest (spec.algorithm.lrSchedule) from `learning_rate`."""
    sched = job.spec.algorithm.lr_schedule
    return LRSchedule(
        learning_rate=learning_rate,
        total_steps=job_steps(job),
        warmup_steps=sched.warmup_steps,
        decay=sched.decay.value,
        min_learning_rate=sched.min_learning_rate,
    )


def serving_recipe(job: RLJob) -> Recipe | None:
    """The serving recipe: spec.rollout.precision and spec.model.bf16Modules (None for bf16)."""
    return _recipe(job.spec.rollout.precision, job)


def training_recipe(job: RLJob) -> Recipe | None:
    """The trainer's forward recipe: spec.trainer.precision (None for bf16, the usual BF16 training)."""
    return _recipe(job.spec.trainer.precision, job)


def _recipe(precision: Precision, job: RLJob) -> Recipe | None:
    if precision is Precision.BF16:
        return None
    return Recipe(Scheme.of(Format(precision.value)), tuple(job.spec.model.bf16_modules))


def backend_config(job: RLJob, *, embedded_engines: bool = False) -> BackendConfig:
    """The backend spec.trainer.backend names, without its model_path (set once the checkpoint is
    resolved, lockstep.train.factory.build_backend)."""
    knobs = trainer_settings(job)
    common = {
        "lr": knobs.learning_rate,
        "grad_clip": knobs.grad_clip,
        "micro_batch_size": knobs.micro_batch_size,
        "seed": knobs.seed,
        "with_ref": knobs.loss.kl_coef > 0,
        "offload": str(_offload(job)),
    }
    if job.spec.trainer.backend is TrainerBackend.MEGATRON:
        return _megatron_config(job, common)
    device = _trainer_device(job)
    recipe = training_recipe(job)  # None: spec.trainer.precision bf16
    return FSDPConfig(
        **common,  # type: ignore[arg-type]
        device=str(device),
        dtype="bfloat16" if device is Device.CUDA and recipe is None else "float32",
        true_on_policy=true_on_policy(job),
        kernels=trainer_kernels_for(job.spec, embedded_engines=embedded_engines) or "lockstep",
        train_recipe=recipe,
        lora=adapter_config(job),
    )


def _megatron_config(job: RLJob, common: dict[str, object]) -> BackendConfig:
    trainer = job.spec.trainer  # bf16 only: rule megatron-trains-bf16 refuses the rest at apply
    p = trainer.parallelism
    return MegatronConfig(
        **common,  # type: ignore[arg-type]
        dtype="bfloat16",
        parallelism=ParallelLayout(p.tensor, p.pipeline, p.context, p.expert, p.expert_tensor),
        stream_optimizer_state=trainer.stream_optimizer_state_to_disk,
        # trainer.localDisk: the node-local directory (a rank pod mounts it at this path)
        state_dir=Path(trainer.local_disk.path) if trainer.local_disk is not None else None,
        export_bucket_bytes=transport_config(job).bucket_bytes,  # the export's buckets are the transport's
    )


def adapter_config(job: RLJob) -> AdapterConfig | None:
    """The adapter spec.model.lora asks for (None: full-weight training); its engine name defaults to
    the job's name."""
    spec = job.spec.model.lora
    if spec is None:
        return None
    return AdapterConfig(
        rank=spec.rank,
        alpha=spec.alpha,
        dropout=spec.dropout,
        target_modules=tuple(spec.target_modules),
        name=spec.adapter_name or job.metadata.name,
    )


def with_transport(job: RLJob, transport: str) -> RLJob:
    """A copy of `job` whose spec.weightSync.transport is `transport` (the operator's choice for `auto`),
    validated like the manifest: a choice the job's rules refuse fails here, naming the rule."""
    if transport_config(job).transport == transport:
        return job
    wire = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    wire["spec"]["weightSync"]["transport"] = transport
    return RLJob.model_validate(wire)


def transport_config(job: RLJob) -> TransportConfig:
    """How versions reach the engines (spec.weightSync, the serving recipe, the trainer's device)."""
    ws = job.spec.weight_sync
    return TransportConfig(
        transport=ws.transport,
        job_name=job.metadata.name,
        bucket_bytes=ws.bucket_mib << 20,
        pause_mode=ws.pause_mode,
        delta_encoding=ws.disk_delta.encoding,
        delta_zstd_level=ws.disk_delta.zstd_level,
        delta_checksum=ws.disk_delta.checksum,
        delta_volume_claim=ws.disk_delta.volume_claim,
        serving=serving_recipe(job),
        trainer_device=_trainer_device(job),
        adapter=adapter_transfer(job),
    )


def adapter_transfer(job: RLJob) -> AdapterTransfer | None:
    """What a LoRA job's updates carry (spec.model.lora): only the adapter, under its name."""
    adapter = adapter_config(job)
    if adapter is None:
        return None
    return AdapterTransfer(name=adapter.name, alpha=adapter.alpha, dropout=adapter.dropout)
