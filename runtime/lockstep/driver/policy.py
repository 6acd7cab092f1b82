"""The run's policy: the trainer group at a URL (RemoteTrainer), or the trainer of this process.

Why it exists: both loops (RL and SFT) train either in this process (the backend built from the
TrainerConfig) or on the TrainerGroup's ranks over HTTP; choosing and starting it is the same for
both, and so is its clean-up (closers).

Who calls it: lockstep.driver.components, lockstep.driver.sft.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lockstep.config.driver import RunConfig
from lockstep.driver.remote import RemoteTrainer
from lockstep.train.factory import build_backend
from lockstep.trainer.local import LocalTrainer
from lockstep.trainer.parts import build_trainer_parts
from lockstep.trainer.sft import SFTTrainer

if TYPE_CHECKING:
    from lockstep.trainer.protocol import Trainer
    from lockstep.weights.inprocess import Handoff


def connect_trainer(
    config: RunConfig, url: str, run_dir: Path, closers: list[Callable[[], None]], timeout_s: float
) -> RemoteTrainer:
    """The trainer group at `url` (its rank 0), waited for until it serves this job."""
    remote = RemoteTrainer(url, run_dir=run_dir)
    closers.append(remote.close)
    remote.wait_ready(config.job_name, timeout_s=timeout_s)
    return remote


def build_trainer(
    config: RunConfig,
    run_dir: Path,
    model_dir: Path,
    engine_urls: list[str],
    closers: list[Callable[[], None]],
    trainer_url: str | None,
    trainer_timeout_s: float,
    *,
    handoffs: Sequence[Handoff] = (),
) -> Trainer:
    """RemoteTrainer at `trainer_url` (waited for), else the FSDP2 backend of this process (whose true
    on-policy kernels match the reference engines this process embeds, if it does: run_config's
    embedded_engines)."""
    if trainer_url is not None:
        return connect_trainer(config, trainer_url, run_dir, closers, trainer_timeout_s)
    backend = build_backend(config.trainer.backend, model_dir)
    closers.append(backend.close)
    parts = build_trainer_parts(
        config.trainer, run_dir, model_dir, backend, engine_urls, closers, handoffs=handoffs
    )
    return LocalTrainer(parts)


def local_sft_trainer(
    config: RunConfig, model_dir: Path, run_dir: Path, pad_id: int, closers: list[Callable[[], None]]
) -> SFTTrainer:
    """An SFT job's trainer in this process: its backend and the SFT steps."""
    backend = build_backend(config.trainer.backend, model_dir)
    closers.append(backend.close)
    return SFTTrainer(backend=backend, settings=config.settings.trainer, run_dir=run_dir, pad_id=pad_id)
