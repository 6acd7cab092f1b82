"""Components: everything one run is made of, built once from the RLJob.

Why it exists: the loops (sync in loop.py, fully-async in fully_async.py) should read like pseudocode
(seed §1); all construction happens here: the model checkpoint resolved, the reference engine(s)
started in-process as real aiohttp servers on 127.0.0.1 (or external engine URLs used), one
EngineClient per engine on the shared LoopThread loop, the trainer backend, the weight transport, the
task and its rollout (plugins loaded and validated), and the metrics sink. The trainer is either in
this process (LocalTrainer: the FSDP2 backend as one rank and the weight transport of
lockstep.weights.factory, spec.weightSync.transport) or the TrainerGroup's ranks reached over HTTP
(RemoteTrainer, when a trainer URL is given: the driver pod of a cluster).

`Components` is a documented slotted dataclass so both loops share it: the fully-async loop takes it as
`run_fully_async(job, components)`.

Who calls it: lockstep.driver.run (and `lockstep run` through it), tests.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.driver.engines import EngineServer, PoolClient, start_reference_engine
from lockstep.driver.remote import RemoteTrainer
from lockstep.driver.report import DriverProgress, ProgressReporter, reporter_from_env
from lockstep.driver.settings import Resume, RunSettings, settings_from_job
from lockstep.driver.threads import share_cpu
from lockstep.models import ChatTokenizer, load_tokenizer, resolve_checkpoint
from lockstep.models.hub_data import resolve_data
from lockstep.models.moe import routing_shape
from lockstep.numerics.recipe import convert_checkpoint, recipe_of
from lockstep.observability.metrics import MetricsSink
from lockstep.rollout.generate import Rollout, RoutedExpertsClient, single_turn
from lockstep.rollout.plugins import AgentContext, RolloutContext, load_plugins
from lockstep.serving.client import EngineClient, EngineUnreachable
from lockstep.serving.loop import LoopThread
from lockstep.serving.membership import ENGINE_PORT, ENGINES_SERVICE_ENV, ServiceMembers, wait_for_serving
from lockstep.serving.payloads import SamplingParams
from lockstep.tasks import Task, TaskItem, data_task
from lockstep.trainer.local import LocalTrainer, build_backend, build_trainer_parts
from lockstep.weights.factory import check_transport, needs_tensor_updates

if TYPE_CHECKING:
    from lockstep.api import RLJob
    from lockstep.trainer.protocol import Trainer
    from lockstep.types import Sample

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Components:
    """The parts of one run. Build with `build_components`, release with `close()`."""

    job: RLJob
    """The validated manifest."""
    settings: RunSettings
    """Plain knobs read from the manifest (steps, batch, intervals, sampling, SFT warm start)."""
    run_dir: Path
    """Run directory: metrics.jsonl, metrics.png, checkpoints/, weights/."""
    model_dir: Path
    """The initial HF checkpoint (resolved from spec.model.checkpoint)."""
    runner: LoopThread
    """The event loop thread every EngineClient coroutine runs on (`runner.run(coro)`)."""
    clients: list[EngineClient]
    """One client per engine replica."""
    engines: list[EngineServer]
    """Engines started in-process by this run (empty when external URLs were given)."""
    trainer: Trainer
    """The policy: train steps, updates to the engines, checkpoints (local or remote)."""
    task: Task
    """Prompts and the default reward."""
    rollout: Rollout
    """Scored-sample production: `rollout.run_sample(sample)` (the async worker's GenerateSample)
    and `rollout.generate_group(...)`."""
    metrics: MetricsSink
    """Per-step JSON lines + Prometheus."""
    pad_id: int = 0
    """Padding token ID for packing."""
    clock: Callable[[], float] = time.monotonic
    """Injected monotonic clock."""
    closers: list[Callable[[], None]] = field(default_factory=list)
    """Extra clean-up callbacks, run in reverse order by close()."""
    resume: Resume = Resume.NEVER
    """Whether to start from the trainer's latest checkpoint (required, if any, never)."""
    stop: threading.Event = field(default_factory=threading.Event)
    """Set by the first Ctrl-C: loops finish the current step, save and return."""
    progress: DriverProgress = field(default_factory=DriverProgress)
    """The progress channel: the loops report the init step, each step, done and fatal errors."""
    engine_ready_timeout_s: float = 60.0
    """How long to wait for the engines to serve (at the start and after the first update)."""

    def item_metadata(self, item: TaskItem) -> dict[str, Any]:
        """What each sample of `item` carries in Sample.metadata (reward functions read it)."""
        return {**item.metadata, "answer": item.answer, "item_index": item.index, "item": item}

    def close(self) -> None:
        """Stop engines, the loop thread, the trainer's process group and the metrics endpoint."""
        for fn in reversed(self.closers):
            try:
                fn()
            except Exception as e:  # clean-up must go on; the error is logged, not lost
                log.warning("clean-up step failed: %s: %s", type(e).__name__, e)
        self.closers.clear()


def check_r3_model(job: RLJob, model_dir: Path) -> None:
    """R3 replays MoE routing: refuse it on a dense checkpoint, naming the field and the fix."""
    if job.spec.algorithm.r3 and routing_shape(model_dir) is None:
        raise ValueError(
            f"spec.algorithm.r3: {job.spec.model.checkpoint} is a dense model (its config.json has no "
            "num_experts / num_experts_per_tok); R3 replays MoE routing: set r3: false"
        )


def build_components(
    job: RLJob,
    run_dir: Path,
    *,
    steps: int | None = None,
    engine_urls: Sequence[str] = (),
    prometheus_port: int = 0,
    cache_dir: Path | None = None,
    connect_retries: int = 5,
    engine_ready_timeout_s: float = 60.0,
    resume: Resume = Resume.NEVER,
    reporter: ProgressReporter | None = None,
    trainer_url: str | None = None,
    trainer_timeout_s: float = 600.0,
) -> Components:
    """Build every part of a run; on any failure, what was already started is stopped again.

    With `trainer_url` the policy lives in the trainer group behind that URL (its rank 0); the
    transport is then the trainer's business and this process never loads the model's weights.
    """
    if trainer_url is None:
        check_transport(job, external_engines=bool(engine_urls), cuda_available=_cuda())
    settings = settings_from_job(job, steps)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    closers: list[Callable[[], None]] = []
    try:
        model_dir = resolve_checkpoint(job.spec.model.checkpoint, cache_dir=cache_dir, seed=settings.seed)
        check_r3_model(job, model_dir)
        model = job.spec.model
        tokenizer = load_tokenizer(model_dir, model.tokenizer, model.chat_template, cache_dir)
        task = data_task(resolve_data(job.spec.data))
        runner = LoopThread()
        closers.append(runner.close)
        engines = (
            [] if engine_urls else _start_engines(job, serving_checkpoint(job, model_dir, run_dir), closers)
        )
        closers.append(share_cpu(_cpu_workers(job, engines, trainer_url)))
        clients = [
            EngineClient(u, retries=connect_retries) for u in [*engine_urls, *(e.url for e in engines)]
        ]
        closers.append(lambda: _close_clients(runner, clients))
        _wait_for_engines(runner, clients, engine_ready_timeout_s, cluster=trainer_url is not None)
        trainer = _build_trainer(
            job,
            settings,
            run_dir,
            model_dir,
            [c.base_url for c in clients],
            closers,
            trainer_url,
            trainer_timeout_s,
            embedded_engines=bool(engines),
        )
        rollout = _build_rollout(job, settings, tokenizer, task, clients)
        metrics = MetricsSink(run_dir / "metrics.jsonl", prometheus_port)
        closers.append(metrics.close)
    except BaseException:
        for fn in reversed(closers):
            try:
                fn()
            except Exception as e:
                log.warning("clean-up after a failed start: %s: %s", type(e).__name__, e)
        raise
    return Components(
        job=job,
        settings=settings,
        run_dir=run_dir,
        model_dir=model_dir,
        runner=runner,
        clients=clients,
        engines=engines,
        trainer=trainer,
        task=task,
        rollout=rollout,
        metrics=metrics,
        pad_id=tokenizer.pad_token_id,
        closers=closers,
        resume=resume,
        engine_ready_timeout_s=engine_ready_timeout_s,
        # None: the environment decides (ConfigMapReporter in a driver pod, else NullReporter).
        progress=DriverProgress(reporter if reporter is not None else reporter_from_env()),
    )


def _wait_for_engines(
    runner: LoopThread, clients: list[EngineClient], timeout_s: float, *, cluster: bool
) -> None:
    """Wait until the engines serve. In a cluster (a driver pod: LOCKSTEP_ENGINES_SERVICE and a trainer
    group) the router Service lists only engines at the job's current weight version (their readiness
    gate), and a (re)started driver establishes that version only with its first update: waiting for
    the router first deadlocked a driver restarted after its engine was replaced (found on the real
    node). So it waits for any engine of the pool's headless Service here, and for the router right
    after the first update (steps.start)."""
    service = os.environ.get(ENGINES_SERVICE_ENV)
    if cluster and service:
        try:
            wait_for_serving(ServiceMembers(service, ENGINE_PORT), timeout_s)
        except TimeoutError as e:
            raise EngineUnreachable(f"http://{service}:{ENGINE_PORT}/health", 1, e) from e
        return
    for client in clients:
        runner.run(client.wait_ready(timeout_s=timeout_s))


def serving_checkpoint(job: RLJob, model_dir: Path, run_dir: Path) -> Path:
    """The checkpoint the engines load: `model_dir`, or with spec.rollout.precision other than bf16 its
    conversion by the job's recipe (seed §6 stage 1) under run_dir/serving-<precision>."""
    serving = recipe_of(job)
    if serving is None:
        return model_dir
    return convert_checkpoint(model_dir, run_dir / f"serving-{serving.scheme.format}", serving)


def _start_engines(job: RLJob, model_dir: Path, closers: list[Callable[[], None]]) -> list[EngineServer]:
    """spec.rollout.replicas reference engines in this process (CUDA when gpusPerEngine > 0 and present).

    They accept tensor updates only when the transport is cuda-ipc (the restricted unpickler is the
    only door for pickled tensors, so it stays shut otherwise)."""
    device = "cuda" if job.spec.rollout.gpus_per_engine > 0 and _cuda() else "cpu"
    allow = needs_tensor_updates(job)  # cuda-ipc sends /update_weights_from_tensor
    engines = []
    for _ in range(max(job.spec.rollout.replicas, 1)):
        server = start_reference_engine(
            model_dir,
            device=device,
            allow_tensor_updates=allow,
            true_on_policy=job.spec.algorithm.true_on_policy,
            kv_cache_dtype=str(job.spec.rollout.kv_cache_dtype),
        )
        closers.append(server.stop)
        engines.append(server)
    return engines


def _build_trainer(
    job: RLJob,
    settings: RunSettings,
    run_dir: Path,
    model_dir: Path,
    engine_urls: list[str],
    closers: list[Callable[[], None]],
    trainer_url: str | None,
    trainer_timeout_s: float,
    *,
    embedded_engines: bool = False,
) -> Trainer:
    """RemoteTrainer at `trainer_url` (waited for), else the FSDP2 backend of this process (whose true
    on-policy kernels match the reference engines this process embeds, if it does)."""
    if trainer_url is not None:
        remote = RemoteTrainer(trainer_url, run_dir=run_dir)
        closers.append(remote.close)
        remote.wait_ready(job.metadata.name, timeout_s=trainer_timeout_s)
        return remote
    backend = build_backend(job, settings.trainer, model_dir, embedded_engines=embedded_engines)
    closers.append(backend.close)
    parts = build_trainer_parts(job, settings.trainer, run_dir, model_dir, backend, engine_urls, closers)
    return LocalTrainer(parts)


def _build_rollout(
    job: RLJob, settings: RunSettings, tokenizer: ChatTokenizer, task: Task, clients: list[EngineClient]
) -> Rollout:
    """Sampling params, the rollout context and the plugins (validated now, named by manifest field)."""
    sampling = SamplingParams(
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        stop_token_ids=list(tokenizer.stop_token_ids),
    )
    ctx = RolloutContext(
        # R3: every /generate asks for the routed experts; an engine that returns none is refused.
        client=RoutedExpertsClient(PoolClient(clients)) if job.spec.algorithm.r3 else PoolClient(clients),
        sampling=sampling,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        encode=tokenizer.encode,
        seed=settings.seed,
    )

    def task_reward(sample: Sample, response: str) -> float:
        return task.reward(response, sample.metadata["item"])

    agent = job.spec.agent
    plugins = load_plugins(
        single_turn,
        task_reward,
        generate_path=agent.generate_function,
        reward_path=agent.reward_function,
        agent_path=agent.agent_function,
    )
    agent_ctx = None
    if plugins.agent is not None:
        timeout = float(agent.timeout_seconds) if agent.timeout_seconds else None
        agent_ctx = AgentContext(
            ctx.client,
            sampling,
            ctx.decode,
            ctx.encode,
            settings.seed,
            max_turns=agent.max_turns,
            timeout_s=timeout,
            # The session server renders turns with the family's chat-template rules (TITO) and the
            # checkpoint's own tokenizer; its new sessions default to spec.rollout.session.
            extra={
                "family": job.spec.model.family,
                "tokenizer_dir": tokenizer.source,
                "session": job.spec.rollout.session.wire(),
            },
        )
        agent_ctx.generate = lambda s: plugins.generate(ctx, s)
    render = lambda msgs: tokenizer.render(msgs, add_generation_prompt=True)  # noqa: E731
    return Rollout(ctx=ctx, plugins=plugins, render=render, agent_ctx=agent_ctx)


def _cpu_workers(job: RLJob, engines: list[EngineServer], trainer_url: str | None) -> int:
    """Threads of this process that compute on the CPU: the in-process trainer and CPU engines."""
    trainer = trainer_url is None and job.spec.trainer.device == "cpu"
    return int(trainer) + sum(str(e.engine.device) == "cpu" for e in engines if e.engine is not None)


def _close_clients(runner: LoopThread, clients: list[EngineClient]) -> None:
    for client in clients:
        runner.run(client.aclose())


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())
