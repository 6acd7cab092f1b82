"""RunOptions: the driver process's options that are not in the manifest (its flags), and Resume.

Why it exists: `lockstep run` and `lockstep driver` read their flags once into RunOptions, and the
driver hands the one object down (lockstep.driver.run -> build_components / run_sft) instead of
copying each option through every signature. The manifest's knobs of a run are lockstep.config.driver's
RunConfig; these are where this process finds its engines, trainer, cache and metrics port, and how
it starts (Resume: `--resume`, a restarted driver pod, or fresh).

Who calls it: lockstep.cli.run, lockstep.cli.driver, lockstep.driver, tests.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path


class Resume(enum.Enum):
    """Whether a run starts from the trainer's latest checkpoint."""

    NEVER = "never"
    """Start fresh (`lockstep run` without --resume)."""
    REQUIRED = "required"
    """Resume; no checkpoint is an error naming where none was found (`--resume`)."""
    IF_ANY = "if-any"
    """Resume when there is a checkpoint, else start fresh (a driver pod, whose restarts resume)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    """What `lockstep run` and `lockstep driver` read from their flags for lockstep.driver.run."""

    steps: int | None = None
    """--steps: overrides spec.schedule.steps."""
    resume: Resume = Resume.NEVER
    """--resume (required), a driver pod (if any), else never."""
    engine_urls: tuple[str, ...] = ()
    """--engine-url: running engines to use instead of starting them."""
    metrics_port: int = 0
    """--metrics-port: Prometheus on 127.0.0.1 (0 = off)."""
    cache_dir: Path | None = None
    """--cache-dir: where builtin:<name> checkpoints are written."""
    engine_timeout_s: float = 60.0
    """--engine-timeout: seconds to wait for the engines."""
    trainer_url: str | None = None
    """--trainer-url (`lockstep driver`): rank 0 of the trainer group; None trains in this process."""
    trainer_timeout_s: float = 600.0
    """--trainer-timeout: seconds to wait for the trainer group."""
    connect_retries: int = 5
    """Attempts of each engine client's first connection."""
    preempted_exit: int = 0
    """Exit code after a SIGTERM's checkpoint: 0 for `lockstep run` (stopped with a checkpoint), 3 for
    the driver pod, whose restartPolicy OnFailure then resumes it if the pod itself stays."""
