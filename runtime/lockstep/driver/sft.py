"""The SFT job's loop (spec.recipe sft): rows of the data source, the assistant-only mask, a step each.

Why it exists: §8, supervised fine-tuning is a job of its own that reuses the trainer, its parallelism,
checkpoints, metrics, resume and status, with no rollout engine at all. Per step the driver takes the
next `algorithm.batchSize` rows of data.prompts (the same sources and data order as RL: JSON lines,
datasets, built-in tasks), renders each conversation with the checkpoint's own chat template and its
assistant-only loss mask (lockstep.models.assistant_mask: a row's `messages` with their assistant turns,
or its prompt with `response` / the reference answer), and the trainer takes one step of the token-mean
NLL on exactly those tokens (lockstep.trainer.sft; in a cluster the TrainerGroup's ranks, over the same
wire as RL). Checkpoints are the trainer's HF-layout checkpoints: the last one loads alone in
transformers. Metrics: loss, tokens/s, learning rate, rows and tokens per step (kind "train" in
metrics.jsonl, and the Step column of the RLJob).

Who calls it: lockstep.driver.loop.run (a job whose spec.recipe is sft).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lockstep.config.driver import RunConfig
from lockstep.driver.inputs import load_inputs
from lockstep.driver.policy import connect_trainer, local_sft_trainer
from lockstep.driver.settings import Resume, RunOptions
from lockstep.driver.threads import share_cpu
from lockstep.models.assistant_mask import conversation_rows
from lockstep.models.tokenizer import ChatTokenizer
from lockstep.observability.metrics import MetricsSink
from lockstep.observability.plot import plot_metrics
from lockstep.progress import DriverProgress
from lockstep.tasks import Task, TaskItem
from lockstep.trainer.protocol import NonFiniteLoss
from lockstep.trainer.sft import SFTRow
from lockstep.trainer.state import DriverState

log = logging.getLogger(__name__)


class SFTSteps(Protocol):
    """What the SFT loop asks of a trainer (SFTTrainer here, RemoteTrainer to a trainer group)."""

    def sft_train(self, rows: Sequence[SFTRow]) -> dict[str, float]: ...
    def save(self, state: DriverState) -> str: ...
    def load_latest(self) -> DriverState | None: ...
    def where(self) -> str: ...
    def shutdown(self) -> None: ...


def sft_messages(item: TaskItem) -> list[dict[str, Any]]:
    """The conversation an SFT row trains on: its messages when they hold assistant turns, else its
    prompt followed by the reply to learn (the row's `response`, or its reference answer) (pure)."""
    messages = [dict(m) for m in item.messages]
    if any(m["role"] == "assistant" for m in messages):
        return messages
    reply = item.metadata.get("response", item.answer)
    if not isinstance(reply, str) or not reply:
        raise ValueError(f"data.prompts row {item.index}: no assistant turn and no response to learn")
    return [*messages, {"role": "assistant", "content": reply}]


def rows_of(tok: ChatTokenizer, task: Task, start: int, n: int) -> list[SFTRow]:
    """The training rows of data items start..start+n-1 (a conversation that the template does not
    render append-only gives one row per assistant turn)."""
    out: list[SFTRow] = []
    for index in range(start, start + n):
        out += conversation_rows(tok, sft_messages(task.item(index, "train")))
    return out


@dataclass(slots=True)
class SFTRun:
    """The parts of one SFT run."""

    trainer: SFTSteps
    tokenizer: ChatTokenizer
    task: Task
    metrics: MetricsSink
    progress: DriverProgress
    steps: int
    job_steps: int
    batch_rows: int
    save_interval: int | None
    run_dir: Path
    closers: list[Callable[[], None]] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic

    def close(self) -> None:
        for fn in reversed(self.closers):
            try:
                fn()
            except Exception as e:  # clean-up goes on; logged, not lost
                log.warning("clean-up step failed: %s: %s", type(e).__name__, e)


def build_sft(config: RunConfig, run_dir: Path, options: RunOptions, progress: DriverProgress) -> SFTRun:
    """Tokenizer, data, the trainer (this process's backend, or the trainer group at `trainer_url`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    closers: list[Callable[[], None]] = []
    try:
        inputs = load_inputs(config, options.cache_dir)
        tok = inputs.tokenizer
        trainer: SFTSteps
        if options.trainer_url is not None:
            trainer = connect_trainer(
                config, options.trainer_url, run_dir, closers, options.trainer_timeout_s
            )
        else:
            if config.trainer.transport.trainer_device == "cpu":
                closers.append(share_cpu(1))  # the one CPU worker of this process: the trainer
            trainer = local_sft_trainer(config, inputs.model_dir, run_dir, tok.pad_token_id, closers)
        metrics = MetricsSink(run_dir / "metrics.jsonl", options.metrics_port)
        closers.append(metrics.close)
    except BaseException:
        for fn in reversed(closers):
            fn()
        raise
    s = config.settings.schedule
    return SFTRun(
        trainer=trainer, tokenizer=tok, task=inputs.task, metrics=metrics, progress=progress, steps=s.steps,
        job_steps=config.job_steps, batch_rows=s.batch_groups, save_interval=s.save_interval,
        run_dir=run_dir, closers=closers,
    )  # fmt: skip


def run_sft_loop(r: SFTRun, resume: Resume, stop: threading.Event) -> DriverState:
    """Steps until r.steps (or `stop`): rows, one trainer step, metrics, checkpoints; returns the state."""
    state = r.trainer.load_latest() if resume is not Resume.NEVER else None
    if state is None and resume is Resume.REQUIRED:
        raise FileNotFoundError(f"--resume: no checkpoint in {r.trainer.where()}; run without --resume")
    state = state or DriverState(sft_done=True)
    r.progress.init({}, r.run_dir, state.step)  # no engines to update: Running from the start
    saved_at = state.step
    while state.step < r.steps and not stop.is_set():
        t0 = r.clock()
        rows = rows_of(r.tokenizer, r.task, state.prompts_consumed, r.batch_rows)
        t1 = r.clock()
        metrics = r.trainer.sft_train(rows)
        state.prompts_consumed += r.batch_rows
        state.step += 1
        metrics |= {"time_data_s": t1 - t0, "step_wall_s": r.clock() - t0}
        if r.save_interval and state.step % r.save_interval == 0:
            r.trainer.save(state)
            saved_at = state.step
        r.metrics.log("train", state.step, metrics)
        r.progress.step(state.step, metrics)
        log.info(
            "sft step %d: loss %.4f, %.0f tokens/s", state.step, metrics["loss"], metrics["sft_tokens_per_s"]
        )
    if saved_at != state.step or state.step == 0:
        r.trainer.save(state)
    plot_metrics(r.metrics.path, r.run_dir / "metrics.png", extra_panels=(("SFT loss", ("loss",)),))
    return state


def run_sft(
    config: RunConfig,
    run_dir: Path,
    options: RunOptions,
    *,
    stop: threading.Event | None = None,
    progress: DriverProgress,
) -> DriverState:
    """Build, loop, report done or a fatal error, release; the final state."""
    r = build_sft(config, Path(run_dir), options, progress)
    try:
        try:
            state = run_sft_loop(r, options.resume, stop or threading.Event())
        except (NonFiniteLoss, ValueError) as e:
            progress.failed(e, r.run_dir)
            raise
        if state.step >= r.steps:
            progress.finished()
        if state.step >= r.job_steps:
            try:
                r.trainer.shutdown()
            except ConnectionError as e:
                log.warning("the trainer was gone before its shutdown (the job is done): %s", e)
        return state
    finally:
        r.close()
