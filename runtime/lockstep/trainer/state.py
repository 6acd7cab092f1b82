"""DriverState and run checkpoints: what resume needs, saved atomically beside the trainer's state.

Why it exists: a run stopped by Ctrl-C, a NaN or a crash must resume exactly: the trainer's weights,
optimizer and RNG (the backend saves those), plus the loop's own position: step, the engines' weight version,
how many prompts were drawn (the data position) and the next group index. A checkpoint directory is
written under a temp name and renamed, then `checkpoints/latest` (a one-line file naming it) is
replaced atomically, so `latest` always names a complete checkpoint.

Layout: RUN_DIR/checkpoints/step_NNNNNN/ (HF config + safetensors + optimizer + RNG + state) and
RUN_DIR/checkpoints/latest.

Who calls it: lockstep.trainer.local (LocalTrainer.save / load_latest: in the driver's process, or on
the trainer ranks of a cluster, whose checkpoints then carry the driver's state), cli/driver.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lockstep.train.backend import TrainBackend


@dataclass(slots=True)
class DriverState:
    """The loop's position; saved in every checkpoint's trainer_state.json under "extra"."""

    step: int = 0
    """Optimizer steps done (RL steps; the SFT warm start does not count)."""
    version: int = 0
    """The weight version the engines hold."""
    prompts_consumed: int = 0
    """Train-split prompts drawn so far (the data position)."""
    next_group_index: int = 0
    """Index of the next group (unique within the run, across resumes)."""
    sft_done: bool = False
    """True once the SFT warm start ran (it never runs twice)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DriverState:
        known = {
            k: data[k]
            for k in ("step", "version", "prompts_consumed", "next_group_index", "sft_done")
            if k in data
        }
        return cls(**known)


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The directory named by checkpoints/latest, or None when the run has none."""
    pointer = checkpoints_dir(run_dir) / "latest"
    if not pointer.is_file():
        return None
    path = checkpoints_dir(run_dir) / pointer.read_text().strip()
    return path if path.is_dir() else None


def save_checkpoint(backend: TrainBackend, run_dir: Path, state: DriverState) -> Path:
    """Save trainer + driver state as checkpoints/step_NNNNNN and point `latest` at it."""
    root = checkpoints_dir(run_dir)
    name = f"step_{state.step:06d}"
    final = root / name
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    backend.save(tmp, extra=state.as_dict())
    if backend.rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = root / ".latest.tmp"
        pointer_tmp.write_text(name + "\n")
        os.replace(pointer_tmp, root / "latest")
    return final
