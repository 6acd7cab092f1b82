"""DriverState and run checkpoints: what resume needs, saved atomically beside the trainer's state.

Why it exists: a run stopped by Ctrl-C, a NaN or a crash must resume exactly: the trainer's weights,
optimizer and RNG (the backend saves those), plus the loop's own position: step, the engines' weight version,
how many prompts were drawn (the data position), the next group index and, fully-async, the groups
drawn but not yet trained and the buffer's counts of groups consumed and dropped. A checkpoint directory is
written under a temp name, fsynced and renamed, then `checkpoints/latest` (a one-line file naming
it) is replaced atomically and durably, so after a crash at any instant `latest` names a complete
checkpoint (save_checkpoint says how, a re-save of the same step included).

Layout: RUN_DIR/checkpoints/step_NNNNNN/ (HF config + safetensors + optimizer + RNG + state) and
RUN_DIR/checkpoints/latest; with a KL term after an SFT warm start, RUN_DIR/reference/ (the KL reference).

Who calls it: lockstep.trainer.local (LocalTrainer.save / load_latest: in the driver's process, or on
the trainer ranks of a cluster, whose checkpoints then carry the driver's state), cli/driver.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.models.st_bytes import fsync_dir
from lockstep.train.common.durable import atomic_write_text, fsync_tree

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
    pending_groups: list[list[int]] = field(default_factory=list)
    """Fully-async: [group index, data position] of every group drawn but not yet trained (buffered or
    in flight) when this state was saved; a resumed run generates them again first, so no prompt is
    skipped or trained twice (lockstep.driver.fully_async)."""
    group_counts: dict[str, int] = field(default_factory=dict)
    """Fully-async: the buffer's counts of groups consumed and dropped so far (consumed_groups,
    stale_groups_filtered, ...; lockstep.rollout.buffer.RUN_COUNTERS) when this state was saved; a
    resumed run's buffer counts on from them, so they never go backwards across a resume."""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("pending_groups", "group_counts"):
            if not out[key]:
                del out[key]  # a sync run's state reads as it always did
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DriverState:
        known = {
            k: data[k]
            for k in (
                "step", "version", "prompts_consumed", "next_group_index", "sft_done", "pending_groups",
                "group_counts",
            )
            if k in data
        }  # fmt: skip
        state = cls(**known)
        state.pending_groups = [[int(g), int(p)] for g, p in state.pending_groups]
        state.group_counts = {str(k): int(n) for k, n in state.group_counts.items()}
        return state


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


REFERENCE = "reference"
"""RUN_DIR/reference: the warm-started policy, the KL reference of a run with an SFT warm start."""


def reference_dir(run_dir: Path) -> Path:
    return Path(run_dir) / REFERENCE


def save_reference(backend: TrainBackend, run_dir: Path) -> Path:
    """Save the backend's current weights as RUN_DIR/reference (HF layout) and return that directory.

    Why: spec.algorithm.kl compares with the policy RL starts from; after an SFT warm start that is the
    warm-started policy, which resume must find again (checkpoints hold the policy, not the reference).
    Written like a checkpoint (rank 0 prepares a temporary directory, every rank writes its files, rank
    0 fsyncs and renames it into place), once, before the first RL step: no checkpoint of the run exists
    yet, so a crash here leaves a run that starts over with its warm start.
    """
    final, tmp = reference_dir(run_dir), Path(run_dir) / f".{REFERENCE}.tmp"
    if backend.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    backend.save(tmp)
    if backend.rank == 0:
        fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(Path(run_dir))
    return final


LATEST = "latest"
"""The pointer file: one line naming the checkpoint directory to resume from."""
_TMP = re.compile(r"\.(step_\d+)\.tmp\d*")
"""Temporary checkpoint directories: .step_NNNNNN.tmp (and .tmp2, left by earlier versions)."""


def _pointed(root: Path) -> str | None:
    pointer = root / LATEST
    return pointer.read_text().strip() or None if pointer.is_file() else None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The directory named by checkpoints/latest, or None when the run has none.

    `latest` may name a temporary copy (a re-save of the step it named points there first); once
    that copy is renamed to its final name, the final name is the same complete checkpoint.
    """
    root = checkpoints_dir(run_dir)
    name = _pointed(root)
    if name is None:
        return None
    if (root / name).is_dir():
        return root / name
    tmp = _TMP.fullmatch(name)
    if tmp is not None and (root / tmp.group(1)).is_dir():
        return root / tmp.group(1)
    return None


def save_checkpoint(backend: TrainBackend, run_dir: Path, state: DriverState) -> Path:
    """Save trainer + driver state as checkpoints/step_NNNNNN and point `latest` at it, durably.

    Called by rank 0 alone (the served trainer: its LeaderBackend mirrors `save` to the other ranks)
    or by every rank (a TrainBackend's methods are collective). Either way rank 0 alone creates,
    renames and removes; the other ranks only write their own files into the temporary directory,
    inside `backend.save`, which starts with a barrier (so after rank 0 prepared the directory) and
    ends with one (so before rank 0 renames it). The temporary name is the same on every rank
    (`.step_NNNNNN.tmp`), so no rank reads `latest` to find it.

    Order (a crash at any point leaves `latest` naming a complete checkpoint):
    0. rank 0 finishes a re-save of this step that a crash cut short (see _finish_resave);
    1. rank 0 removes a stale temporary directory and creates it; every rank writes into it
       (each file temp + fsync + rename);
    2. rank 0 fsyncs the whole tree; if `latest` names the step being re-saved, it now points at the
       complete temporary copy, so the old one may go;
    3. an old directory of the step is moved aside, the temporary one renamed into place, the
       parent fsynced; 4. `latest` is replaced atomically; 5. leftovers are removed.
    """
    root = checkpoints_dir(run_dir)
    name = f"step_{state.step:06d}"
    final = root / name
    tmp = root / f".{name}.tmp"
    if backend.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _finish_resave(root, name)
        if tmp.exists():  # a crashed save's partial copy; no pointer names it
            shutil.rmtree(tmp)
        tmp.mkdir()
    backend.save(tmp, extra=state.as_dict())
    if backend.rank == 0:
        fsync_tree(tmp)
        fsync_dir(root)
        if final.exists():
            if latest_checkpoint(run_dir) == final:
                atomic_write_text(root / LATEST, tmp.name + "\n")
            _replace_final(root, name)
        else:
            os.replace(tmp, final)
        fsync_dir(root)
        atomic_write_text(root / LATEST, name + "\n")
        _remove_leftovers(root, keep=name)
    return final


def _replace_final(root: Path, name: str) -> None:
    """Put the complete `.name.tmp` in place of `name`: the old copy is moved aside first (`.name.old`,
    removed later), so `name` is never a half-removed directory."""
    old = root / f".{name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if (root / name).exists():
        os.replace(root / name, old)
    os.replace(root / f".{name}.tmp", root / name)


def _finish_resave(root: Path, name: str) -> None:
    """A re-save of `name` crashed after pointing `latest` at its complete temporary copy: move that
    copy into place (unless the crash came after the move) and point `latest` at `name`, so the
    temporary directory is free for this save and nothing a pointer names is removed."""
    if _pointed(root) != f".{name}.tmp":
        return
    if (root / f".{name}.tmp").is_dir():
        _replace_final(root, name)
        fsync_dir(root)
    atomic_write_text(root / LATEST, name + "\n")


def _remove_leftovers(root: Path, *, keep: str) -> None:
    """Temporary and moved-aside directories no pointer names any more (from this or a crashed save)."""
    for path in root.iterdir():
        if path.name == keep:
            continue
        if path.is_dir() and (_TMP.fullmatch(path.name) or path.name.endswith(".old")):
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith(f".{LATEST}.tmp-"):  # a pointer write cut short
            path.unlink(missing_ok=True)
