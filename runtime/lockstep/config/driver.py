"""The driver side's configs from an RLJob: RunConfig and what it holds (pure, golden-tested).

Why it exists: every manifest field the driver process reads is read here, once. `run_config` builds
the RunConfig of one run; the driver (lockstep.driver) builds its components from it and never reads
`job.spec`. The driver's own knobs (Schedule, RunSettings, AsyncSettings, EngineSetup, AgentSetup,
SandboxSetup) are declared here because lockstep.driver sits above this package; the configs of the
components below the driver (TrainerConfig, TransportConfig, SandboxConfig, OPDConfig, TeacherSetup)
are declared next to them and built here or in lockstep.config.trainer / lockstep.config.opd.

Who calls it: lockstep.driver.loop.run (once per run), lockstep.cli.driver, tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from lockstep.api import ScheduleMode, sandbox_concurrency
from lockstep.config.opd import opd_config, teacher_setup
from lockstep.config.trainer import (
    adapter_config,
    batch_shape,
    job_steps,
    sft_job,
    trainer_config,
    trainer_settings,
    true_on_policy,
)
from lockstep.rollout.opd.config import OPDConfig, TeacherSetup
from lockstep.sandbox.base import SandboxConfig, parse_quantity
from lockstep.weights.factory import needs_tensor_updates

if TYPE_CHECKING:
    from lockstep.api import RLJob, SandboxSpec
    from lockstep.numerics.recipe import Recipe
    from lockstep.trainer.settings import TrainerConfig, TrainerSettings

TERMINAL_AGENT: Final = "lockstep.rollout.terminal:terminal_agent"
"""The agent function of a sandbox job whose manifest names none."""
TEST_REWARD: Final = "lockstep.tasks.shell:reward"
"""The reward function of a sandbox job whose manifest names none: the test script's verdict."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """What both loops count: steps, the batch, and when to update weights, save and evaluate."""

    steps: int
    """Optimizer steps to reach (a resumed run continues up to this)."""
    batch_groups: int
    """Groups per step (spec.algorithm.batchSize)."""
    samples_per_prompt: int
    """Samples per group (spec.algorithm.samplesPerPrompt)."""
    update_interval: int = 1
    """Update the engines' weights every this many steps (versions == steps only when 1)."""
    save_interval: int | None = None
    """Save every this many steps (always at the end)."""
    eval_interval: int | None = None
    """Evaluate every this many steps (and before the first step and at the end when set)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_groups", "samples_per_prompt", "update_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSettings:
    """The driver's knobs; the trainer's are nested as the trainer builds them."""

    schedule: Schedule
    """Steps, batch, intervals (both loops)."""
    seed: int
    """Run seed (spec.data.seed): data order, sampling seeds, random init."""
    temperature: float
    """Rollout sampling temperature."""
    top_p: float
    """Rollout nucleus mass."""
    max_new_tokens: int
    """Most tokens per reply."""
    eval_temperature: float
    """Sampling temperature of evaluation (0 = greedy)."""
    trainer: TrainerSettings
    """The trainer side's knobs (learning rates, SFT warm start, loss)."""
    max_groups_per_step: int | None = None
    """Dynamic sampling (spec.algorithm.dynamicSampling): most groups generated per step, dropped
    groups without a reward spread included; None trains every group generated."""


@dataclass(slots=True, frozen=True, kw_only=True)
class AsyncSettings:
    """The fully-async loop's knobs: the run's Schedule (the same object) and the async-only ones."""

    schedule: Schedule
    """Steps, batch, intervals: what the sync loop counts too."""
    max_in_flight: int
    """Trajectories kept generating at once (spec.rollout.maxInFlight); >= samples per prompt."""
    max_staleness: int | None = None
    """Bound on S_old in published versions (spec.schedule.maxWeightStaleness); None never rejects."""
    buffer_groups: int | None = None
    """Buffer capacity in groups; None means 2 x batch_groups."""
    sample_timeout_s: float | None = None
    """Per-trajectory limit (spec.agent.timeoutSeconds); an over-long trajectory is aborted, its group
    dropped at put."""
    eval_pins_version: bool = True
    """When evaluation shares the rollout engines, the next weight update waits for running evaluations so a
    score never mixes checkpoints (training and generation continue meanwhile; only the update waits)."""

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.max_in_flight < self.schedule.samples_per_prompt:
            raise ValueError(
                f"spec.rollout.maxInFlight ({self.max_in_flight}) must be >= spec.algorithm.samplesPerPrompt "
                f"({self.schedule.samples_per_prompt}): a whole group is submitted at once"
            )

    @property
    def capacity(self) -> int:
        """The buffer capacity actually used."""
        return self.buffer_groups if self.buffer_groups is not None else 2 * self.schedule.batch_groups


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSetup:
    """The reference engines a local run serves in this process (lockstep.driver.engines)."""

    replicas: int
    """Engines to start (spec.rollout.replicas, at least 1)."""
    wants_gpu: bool
    """spec.rollout.gpusPerEngine > 0: on CUDA when this machine has it."""
    true_on_policy: bool
    """spec.algorithm.trueOnPolicy: the trainer's batch-invariant kernels."""
    kv_cache_dtype: str
    """spec.rollout.kvCacheDtype (SGLang's values)."""
    max_lora_rank: int | None
    """A LoRA job's adapter rank (spec.model.lora.rank); None serves no adapters."""
    allow_tensor_updates: bool
    """The transport is cuda-ipc: /update_weights_from_tensor is opened (pickled tensors)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentSetup:
    """The rollout's plugins and the multi-turn agent's knobs (spec.agent, spec.rollout.session)."""

    generate_function: str | None
    """spec.agent.generateFunction (None: single-turn generation)."""
    agent_function: str | None
    """spec.agent.agentFunction, or the terminal agent of a sandbox job."""
    reward_function: str | None
    """spec.agent.rewardFunction, or a sandbox job's test-script verdict."""
    group_filter_function: str | None
    """spec.agent.groupFilterFunction (fully-async)."""
    max_turns: int | None
    """spec.agent.maxTurns."""
    timeout_s: float | None
    """spec.agent.timeoutSeconds."""
    family: str
    """spec.model.family: the session server's chat-template rules (TITO)."""
    session: dict[str, Any]
    """spec.rollout.session on the wire: a new session's defaults."""
    dp_size: int
    """spec.rollout.dataParallelAttention: the engines' DP-attention ranks a session sticks to one of."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxSetup:
    """A sandbox job's sandboxes (spec.agent.sandbox): what each one is and how many at once."""

    config: SandboxConfig
    """What every sandbox of the job is (image, limits, egress)."""
    concurrency: int
    """Sandboxes the job claims at once (lockstep.api.sandbox_concurrency)."""
    job_name: str
    """The job's name: its claims are labelled with it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """Everything the driver process reads from the manifest, built once (`run_config`)."""

    job_name: str
    """metadata.name."""
    sft: bool
    """spec.recipe is sft: the SFT loop, no engines, no rollout."""
    fully_async: bool
    """spec.schedule.mode is fully-async."""
    job_steps: int
    """spec.schedule.steps: reached, the job is done (a --steps override ends the run earlier)."""
    settings: RunSettings
    """The loops' knobs (with the --steps override)."""
    async_settings: AsyncSettings
    """The fully-async loop's knobs around settings.schedule."""
    trainer: TrainerConfig
    """The trainer of a local run (and the model source and data both sides read)."""
    serving: Recipe | None
    """The engines' serving recipe (spec.rollout.precision; None for bf16)."""
    engines: EngineSetup
    """This process's reference engines (a run without engine URLs)."""
    r3: bool
    """spec.algorithm.r3: every /generate asks for the routed experts."""
    adapter: str | None
    """A LoRA job's adapter name on the engines; None: full-weight training."""
    agent: AgentSetup
    """The rollout's plugins and agent knobs."""
    sandbox: SandboxSetup | None
    """spec.agent.sandbox; None without sandboxes."""
    pause_mode: str
    """spec.weightSync.pauseMode: how the fully-async loop holds in-flight requests during an update."""
    opd: OPDConfig | None
    """On-policy distillation's routing and scoring (spec.algorithm.opd); None without it."""
    teachers: TeacherSetup
    """Where OPD's teachers are served."""


def needs_engines(job: RLJob) -> bool:
    """Whether the driver samples from engines (every recipe but sft)."""
    return not sft_job(job)


def run_config(job: RLJob, *, steps: int | None = None, embedded_engines: bool = False) -> RunConfig:
    """The RunConfig of `job`; `steps` (--steps) overrides spec.schedule.steps; embedded_engines: the
    engines are this process's reference engines (no engine URLs; an SFT job has none). Each manifest
    field is read once, in the function that maps it; the others take its value from that config."""
    settings = run_settings(job, steps)
    trainer = trainer_config(job, embedded_engines=embedded_engines and needs_engines(job))
    fully_async = job.spec.schedule.mode is ScheduleMode.FULLY_ASYNC
    loop = async_settings(job, settings.schedule)
    engines = engine_setup(job, trainer)
    return RunConfig(
        job_name=job.metadata.name,
        sft=trainer.settings.sft_job,
        fully_async=fully_async,
        job_steps=job_steps(job),
        settings=settings,
        async_settings=loop,
        trainer=trainer,
        serving=trainer.transport.serving,
        engines=engines,
        r3=job.spec.algorithm.r3,
        adapter=trainer.transport.adapter.name if trainer.transport.adapter is not None else None,
        agent=agent_setup(job),
        sandbox=sandbox_setup(job, loop, fully_async=fully_async),
        pause_mode=trainer.transport.pause_mode,
        opd=opd_config(job),
        teachers=teacher_setup(
            job,
            seed=settings.seed,
            true_on_policy=engines.true_on_policy,
            kv_cache_dtype=engines.kv_cache_dtype,
        ),
    )


def engine_setup(job: RLJob, trainer: TrainerConfig) -> EngineSetup:
    """The reference engines of a local run (spec.rollout) with the trainer's numerics and transport."""
    rollout = job.spec.rollout
    adapter = adapter_config(job)
    return EngineSetup(
        replicas=max(rollout.replicas, 1),
        wants_gpu=rollout.gpus_per_engine > 0,
        true_on_policy=true_on_policy(job),
        kv_cache_dtype=str(rollout.kv_cache_dtype),
        max_lora_rank=adapter.rank if adapter is not None else None,
        allow_tensor_updates=needs_tensor_updates(trainer.transport),
    )


def run_settings(job: RLJob, steps: int | None = None) -> RunSettings:
    """Read the driver's knobs from `job`; `steps` (the --steps flag) overrides spec.schedule.steps."""
    spec = job.spec
    sampling = spec.rollout.sampling
    trainer = trainer_settings(job)  # the seed and the temperature are read there
    groups, samples = batch_shape(job)
    steps = steps if steps is not None else job_steps(job)
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    return RunSettings(
        schedule=Schedule(
            steps=steps,
            batch_groups=groups,
            samples_per_prompt=samples,
            update_interval=spec.weight_sync.update_interval,
            save_interval=spec.schedule.save_interval,
            eval_interval=spec.schedule.eval_interval,
        ),
        seed=trainer.seed,
        temperature=trainer.temperature,
        top_p=sampling.top_p,
        max_new_tokens=sampling.max_new_tokens,
        eval_temperature=spec.schedule.eval_temperature,
        trainer=trainer,
        max_groups_per_step=(
            spec.algorithm.dynamic_sampling.max_groups_per_step if spec.algorithm.dynamic_sampling else None
        ),
    )


def async_settings(job: RLJob, schedule: Schedule) -> AsyncSettings:
    """The fully-async loop's knobs from the manifest around the run's Schedule."""
    spec = job.spec
    return AsyncSettings(
        schedule=schedule,
        max_in_flight=spec.rollout.max_in_flight,
        max_staleness=spec.schedule.max_weight_staleness,
        buffer_groups=spec.schedule.buffer_groups,
        sample_timeout_s=agent_setup(job).timeout_s,  # spec.agent.timeoutSeconds
    )


def agent_setup(job: RLJob) -> AgentSetup:
    """spec.agent's functions (a sandbox job defaults to the terminal agent and its test) and knobs."""
    agent = job.spec.agent
    sandboxed = agent.sandbox is not None
    return AgentSetup(
        generate_function=agent.generate_function,
        agent_function=agent.agent_function or (TERMINAL_AGENT if sandboxed else None),
        reward_function=agent.reward_function or (TEST_REWARD if sandboxed else None),
        group_filter_function=agent.group_filter_function,
        max_turns=agent.max_turns,
        timeout_s=float(agent.timeout_seconds) if agent.timeout_seconds else None,
        family=job.spec.model.family,
        session=job.spec.rollout.session.wire(),
        dp_size=job.spec.rollout.data_parallel_attention,
    )


def sandbox_setup(job: RLJob, loop: AsyncSettings, *, fully_async: bool) -> SandboxSetup | None:
    """The job's sandboxes (spec.agent.sandbox), None without; as many at once as the loop (`loop`, and
    `fully_async`: spec.schedule.mode) keeps samples in flight."""
    box = job.spec.agent.sandbox
    if box is None:
        return None
    return SandboxSetup(
        config=sandbox_config(box),
        concurrency=sandbox_concurrency(
            sandbox=box,
            max_in_flight=loop.max_in_flight,
            samples_per_step=loop.schedule.batch_groups * loop.schedule.samples_per_prompt,
            fully_async=fully_async,
        ),
        job_name=job.metadata.name,
    )


def sandbox_config(spec: SandboxSpec) -> SandboxConfig:
    """The typed config every sandbox of the job shares (pure)."""
    return SandboxConfig(
        image=spec.image,
        working_dir=spec.working_dir,
        command_timeout_s=float(spec.command_timeout_seconds),
        output_limit=spec.output_limit_bytes,
        cpu_cores=parse_quantity(spec.resources.cpu),
        memory_bytes=math.ceil(parse_quantity(spec.resources.memory)),
        disk_bytes=math.ceil(parse_quantity(spec.resources.ephemeral_storage)),
        egress=spec.egress == "allow",
    )
