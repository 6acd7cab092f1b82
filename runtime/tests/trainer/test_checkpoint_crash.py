"""Checkpoints survive a crash at every stage of a save: the writer process is killed (SIGKILL) before
each file-system step of save_checkpoint in turn (every rename, fsync and removal), then a resume
must load a complete checkpoint, old or new, and the next save must succeed.

Three saves are crashed at every stage: the first save of a run, the next step's save, and a
re-save of the step `latest` names (which used to delete it before the new one existed). The writer
is a forked child of the test (a real process, killed for real); its backend writes and reads like
the real ones: safetensors weights, torch.save state read back with weights_only=True, JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from lockstep.train.common.durable import atomic_path, atomic_write_text
from lockstep.trainer.state import DriverState, latest_checkpoint, save_checkpoint
from safetensors.torch import load_file, save_file


class _Backend:
    """The checkpoint-writing surface of a TrainBackend, writing files as the real backends do."""

    rank = 0
    world_size = 1

    def __init__(self, mark: float) -> None:
        self.mark = mark

    def save(self, directory: Path, extra: dict[str, Any] | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_path(directory / "model.safetensors") as tmp:
            save_file({"w": torch.full((64, 64), self.mark)}, str(tmp))
        with atomic_path(directory / "optimizer.pt") as tmp:
            torch.save({"exp_avg": torch.full((64,), self.mark), "step": 3}, tmp)
        atomic_write_text(directory / "trainer_state.json", json.dumps({"mark": self.mark, "extra": extra}))


def _load(directory: Path) -> tuple[float, dict[str, Any]]:
    """Read a checkpoint completely; raises if any part is missing or torn."""
    w = load_file(str(directory / "model.safetensors"))["w"]
    opt = torch.load(directory / "optimizer.pt", weights_only=True)
    state = json.loads((directory / "trainer_state.json").read_text())
    mark = float(state["mark"])
    assert bool((w == mark).all()) and bool((opt["exp_avg"] == mark).all()) and opt["step"] == 3
    extra: dict[str, Any] = state["extra"]
    return mark, extra


def _save_killed_at(run_dir: Path, step: int, mark: float, stage: int) -> bool:
    """Fork a writer that is SIGKILLed just before its `stage`-th file-system step; True when it was
    killed, False when the save finished before reaching that stage."""
    pid = os.fork()
    if pid == 0:  # the writer
        count = [0]

        def step_then(fn: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                count[0] += 1
                if count[0] == stage:
                    os.kill(os.getpid(), signal.SIGKILL)
                return fn(*args, **kwargs)

            return wrapped

        os.replace = step_then(os.replace)  # type: ignore[assignment]
        os.fsync = step_then(os.fsync)  # type: ignore[assignment]
        shutil.rmtree = step_then(shutil.rmtree)  # type: ignore[assignment]
        try:
            save_checkpoint(_Backend(mark), run_dir, DriverState(step=step))  # type: ignore[arg-type]
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status)


def _prepare(run_dir: Path, scenario: str) -> None:
    if scenario in ("next step", "re-save"):
        save_checkpoint(_Backend(1.0), run_dir, DriverState(step=1))  # type: ignore[arg-type]
    if scenario == "re-save":
        save_checkpoint(_Backend(2.0), run_dir, DriverState(step=2))  # type: ignore[arg-type]


SCENARIOS = {
    # scenario: (step saved, its mark, marks a resume may find)
    "first save": (1, 1.0, {None, 1.0}),
    "next step": (2, 2.0, {1.0, 2.0}),
    "re-save": (2, 3.0, {2.0, 3.0}),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_crash_at_any_stage_leaves_a_complete_checkpoint(tmp_path: Path, scenario: str) -> None:
    step, mark, allowed = SCENARIOS[scenario]
    stage, killed = 0, True
    while killed:
        stage += 1
        run_dir = tmp_path / f"stage{stage}"
        _prepare(run_dir, scenario)
        killed = _save_killed_at(run_dir, step, mark, stage)
        found = latest_checkpoint(run_dir)
        got = None if found is None else _load(found)[0]  # complete, or this raises
        assert got in allowed, f"{scenario}, killed at stage {stage}: resumed mark {got}"
        if killed:  # the next save after the crash goes through and is what a resume finds
            save_checkpoint(_Backend(9.0), run_dir, DriverState(step=step))  # type: ignore[arg-type]
            again = latest_checkpoint(run_dir)
            assert again is not None and _load(again)[0] == 9.0, f"{scenario}, stage {stage}"
            leftovers = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("."))
            assert leftovers == [], f"{scenario}, stage {stage}: {leftovers}"
    assert stage > 10  # every rename, fsync and removal of the save was a crash point
    assert _load(latest_checkpoint(run_dir))[0] == mark  # type: ignore[arg-type]
