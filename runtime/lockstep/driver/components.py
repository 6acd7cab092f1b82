"""Components: everything one run is made of, built once from the RunConfig.

Why it exists: the loops (sync in loop.py, fully-async in fully_async.py) should read like pseudocode
(§1); construction happens before them, here, in the order a run needs its parts: the inputs
(inputs.py: checkpoint, tokenizer, task), the reference engine(s) started in-process as real aiohttp
servers on 127.0.0.1 or external engine URLs (engines.py), one EngineClient per engine on the shared
LoopThread loop, OPD's teachers (opd.py), the policy (policy.py: this process's trainer, or the
TrainerGroup's ranks over HTTP when a trainer URL is given), the sandboxes (sandboxes.py), the rollout
(rollout.py: plugins loaded and validated) and the metrics sink. This module is the driver's
composition root: it names every part, so it imports more modules than the rule of
docs/engineering.md allows (its exception is listed there).

`Components` is a documented slotted dataclass so both loops share it: `run_sync(c)` and
`run_fully_async(c)` take it.

Who calls it: lockstep.driver.loop.run (and `lockstep run`, `lockstep driver` through it), tests, bench.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.config.driver import RunConfig, RunSettings
from lockstep.driver.engines import (
    EngineServer,
    close_clients,
    cuda_available,
    engine_device,
    serving_checkpoint,
    start_engines,
    wait_for_engines,
)
from lockstep.driver.inputs import load_inputs
from lockstep.driver.lora import adapter_reporter, versioned_trainer
from lockstep.driver.opd import build_opd, resolve_teachers
from lockstep.driver.policy import build_trainer
from lockstep.driver.rollout import build_rollout
from lockstep.driver.sandboxes import build_sandboxes
from lockstep.driver.settings import Resume, RunOptions
from lockstep.driver.threads import share_cpu
from lockstep.observability.metrics import MetricsSink
from lockstep.progress import DriverProgress, ProgressReporter, reporter_from_env
from lockstep.serving.client import EngineClient
from lockstep.serving.loop import LoopThread
from lockstep.weights.factory import check_transport

if TYPE_CHECKING:
    from lockstep.driver.preemption import Preemption
    from lockstep.rollout.generate import Rollout
    from lockstep.rollout.opd.scorer import TeacherScorer
    from lockstep.tasks import Task, TaskItem
    from lockstep.trainer.protocol import Trainer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Components:
    """The parts of one run. Build with `build_components`, release with `close()`."""

    config: RunConfig
    """Everything read from the manifest (lockstep.config.driver), once."""
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
    preemption: Preemption | None = None
    """SIGTERM's state (lockstep.driver.preemption): loops abandon rollout waits and checkpoint at once."""
    progress: DriverProgress = field(default_factory=DriverProgress)
    """The progress channel: the loops report the init step, each step, done and fatal errors."""
    engine_ready_timeout_s: float = 60.0
    """How long to wait for the engines to serve (at the start and after the first update)."""
    opd: TeacherScorer | None = None
    """On-policy distillation: the teacher scorer every finished sample passes through (also
    rollout.scorer); None without spec.algorithm.opd."""

    @property
    def settings(self) -> RunSettings:
        """The loops' knobs (steps, batch, intervals, sampling, SFT warm start): config.settings."""
        return self.config.settings

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


def build_components(
    config: RunConfig,
    run_dir: Path,
    options: RunOptions | None = None,
    *,
    reporter: ProgressReporter | None = None,
) -> Components:
    """Build every part of a run; on any failure, what was already started is stopped again.

    With options.trainer_url the policy lives in the trainer group behind that URL (its rank 0); the
    transport is then the trainer's business and this process never loads the model's weights.
    """
    o = options if options is not None else RunOptions()
    engine_urls, cache_dir, trainer_url = o.engine_urls, o.cache_dir, o.trainer_url
    if trainer_url is None:
        check_transport(
            config.trainer.transport, external_engines=bool(engine_urls), cuda_available=cuda_available()
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    closers: list[Callable[[], None]] = []
    try:
        inputs = load_inputs(config, cache_dir)
        model_dir, tokenizer = inputs.model_dir, inputs.tokenizer
        runner = LoopThread()
        closers.append(runner.close)
        distill = config.opd
        teachers = (  # first: a teacher this process cannot reach fails before any engine starts
            resolve_teachers(
                config.teachers, cache_dir=cache_dir, closers=closers, device=engine_device(config.engines)
            )
            if distill is not None
            else None
        )
        engines = (
            []
            if engine_urls
            else start_engines(
                config.engines, serving_checkpoint(config.serving, model_dir, run_dir), closers
            )
        )
        closers.append(
            share_cpu(_cpu_workers(config, [*engines, *(teachers.engines if teachers else [])], trainer_url))
        )
        clients = [
            EngineClient(u, retries=o.connect_retries) for u in [*engine_urls, *(e.url for e in engines)]
        ]
        closers.append(lambda: close_clients(runner, clients))
        wait_for_engines(runner, clients, o.engine_timeout_s, cluster=trainer_url is not None)
        opd = (
            build_opd(
                distill,
                runner,
                teachers,
                clients,
                len(tokenizer.hf),
                closers,
                ready_timeout_s=o.engine_timeout_s,
            )
            if distill is not None and teachers is not None
            else None
        )
        trainer = build_trainer(
            config,
            run_dir,
            model_dir,
            [c.base_url for c in clients],
            closers,
            trainer_url,
            o.trainer_timeout_s,
            handoffs=[e.handoff for e in engines if e.handoff is not None],
        )
        sandboxes = build_sandboxes(config.sandbox, run_dir)
        if sandboxes is not None:
            closers.append(lambda: runner.run(sandboxes.aclose()))
        rollout = build_rollout(config, tokenizer, inputs.task, clients, sandboxes)
        trainer = versioned_trainer(trainer, rollout)  # a LoRA job samples the version last published
        rollout.scorer = opd
        metrics = MetricsSink(run_dir / "metrics.jsonl", o.metrics_port)
        closers.append(metrics.close)
    except BaseException:
        for fn in reversed(closers):
            try:
                fn()
            except Exception as e:
                log.warning("clean-up after a failed start: %s: %s", type(e).__name__, e)
        raise
    return Components(
        config=config,
        run_dir=run_dir,
        model_dir=model_dir,
        runner=runner,
        clients=clients,
        engines=engines,
        trainer=trainer,
        task=inputs.task,
        rollout=rollout,
        metrics=metrics,
        pad_id=tokenizer.pad_token_id,
        closers=closers,
        resume=o.resume,
        engine_ready_timeout_s=o.engine_timeout_s,
        opd=opd,
        # None: the environment decides (ConfigMapReporter in a driver pod, else NullReporter).
        progress=DriverProgress(
            # a LoRA job's probe reads adapter versions, whoever built the reporter (the loop builds
            # the driver pod's ConfigMapReporter and passes it in)
            adapter_reporter(config.adapter, reporter if reporter is not None else reporter_from_env())
        ),
    )


def _cpu_workers(config: RunConfig, engines: list[EngineServer], trainer_url: str | None) -> int:
    """Threads of this process that compute on the CPU: the in-process trainer and CPU engines."""
    trainer = trainer_url is None and config.trainer.transport.trainer_device == "cpu"
    return int(trainer) + sum(str(e.engine.device) == "cpu" for e in engines if e.engine is not None)
