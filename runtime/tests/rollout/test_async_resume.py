"""Lossless fully-async resume: `lockstep run` killed with SIGKILL at 3 random points and resumed.

Each run is a real `lockstep run` process (reference engine on 127.0.0.1, FSDP trainer, checkpoints every
2 steps). A fully-async run draws prompts ahead of training (the buffer and the groups in flight); a
checkpoint used to save only the draw position, so a resumed run skipped every drawn-but-untrained
prompt. Now each checkpoint carries them (DriverState.pending_groups) and a resumed run generates them
again first. Which prompts each step trained is in metrics.jsonl (`data` rows; the redone steps of the
crashed runs are superseded by the resume markers, lockstep.observability.metrics).

- With one group in flight at a time the order is fixed by the data, so the killed run trains the same
  prompts as an uninterrupted run, step for step.
- With 4 groups in flight it is not; there, every prompt drawn is trained exactly once or still pending
  at the end (none skipped, none twice), as in the uninterrupted run.
- Staleness restarts from the checkpoint's version (docs/fully-async.md, "Checkpoint and resume"): the
  engines hold that version before any group is drawn again, every group trained after the resume was
  generated at or after it (the first step measures 0, none negative, none lagging more than the
  versions published since the resume), no group is dropped as stale for the crash's sake, and the
  buffer's counters continue from the checkpoint's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from lockstep.observability.metrics import read_jsonl
from lockstep.trainer.state import DriverState, latest_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-async.yaml"
STEPS = 8
SEED = 20261205
"""Seeds the kill points (printed on failure)."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600), pytest.mark.heavy]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _manifest(tmp_path: Path, in_flight_groups: int, max_staleness: int | None = None) -> Path:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["algorithm"] |= {"batchSize": 2, "samplesPerPrompt": 2}
    doc["spec"]["rollout"]["maxInFlight"] = 2 * in_flight_groups
    doc["spec"]["rollout"]["sampling"]["maxNewTokens"] = 4
    schedule = doc["spec"]["schedule"]
    schedule |= {"steps": STEPS, "saveInterval": 2}
    for key in ("maxWeightStaleness", "evalInterval"):  # no group dropped as stale, no eval: just training
        schedule.pop(key, None)
    if max_staleness is not None:
        schedule["maxWeightStaleness"] = max_staleness
    path = tmp_path / f"job-{in_flight_groups}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _start(manifest: Path, run_dir: Path, cache: Path, *, resume: bool, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "lockstep", "run", str(manifest), "--run-dir", str(run_dir)]
    cmd += ["--cache-dir", str(cache), *(["--resume"] if resume else [])]
    with log.open("a") as out:
        return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=out)


def _rows_logged(run_dir: Path) -> int:
    """Train rows every process wrote so far (redone ones included)."""
    return len(read_jsonl(run_dir / "metrics.jsonl", "train", raw=True))


def _run(manifest: Path, run_dir: Path, cache: Path, kills: list[tuple[int, float]]) -> list[str]:
    """Run to the end; per kill (n, frac), SIGKILL the process after it logged its n-th train step, frac
    of its last step interval later (resuming, as a user would, whenever a checkpoint exists); returns
    what happened. The delay is a fraction of a step, not seconds: on a fast machine a delay in seconds
    let a process run to the end before its kill."""
    log, seen = run_dir.parent / f"{run_dir.name}.log", []
    for i, (n, frac) in enumerate(kills):
        before = _rows_logged(run_dir)
        proc = _start(manifest, run_dir, cache, resume=latest_checkpoint(run_dir) is not None, log=log)
        deadline = time.monotonic() + 900  # a hang guard, not a timing assertion
        row_times: list[float] = []
        while len(row_times) < n and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            row_times += [time.monotonic()] * (_rows_logged(run_dir) - before - len(row_times))
            time.sleep(0.05)
        delay = frac * (row_times[-1] - row_times[-2]) if len(row_times) >= 2 else 0.0
        time.sleep(delay)
        assert proc.poll() is None, f"finished before kill {i}: {log.read_text()[-3000:]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        seen.append(f"killed after {_rows_logged(run_dir) - before} steps of its own (+{delay:.2f} s)")
    proc = _start(manifest, run_dir, cache, resume=latest_checkpoint(run_dir) is not None, log=log)
    try:
        rc = proc.wait(timeout=900)  # a hang guard, not a timing assertion
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the last run hung: {log.read_text()[-3000:]}") from None
    assert rc == 0, log.read_text()[-3000:]
    return seen


def _trained(run_dir: Path) -> list[list[int]]:
    """Per step (effective history), the data positions trained."""
    rows = read_jsonl(run_dir / "metrics.jsonl", "data")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    return [list(r["positions"]) for r in rows]


def _final_state(run_dir: Path) -> DriverState:
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None
    return DriverState.from_dict(json.loads((checkpoint / "trainer_state.json").read_text())["extra"])


def _kills() -> list[tuple[int, float]]:
    """3 kills, each after 1-2 steps of the process plus up to half a step: each process advances at
    most 3 steps past its checkpoint (every 2 steps), so the third still ends before step 8."""
    rng = random.Random(SEED)
    return [(rng.randint(1, 2), rng.uniform(0.0, 0.5)) for _ in range(3)]


def test_killed_three_times_trains_the_prompts_of_an_uninterrupted_run_step_for_step(
    tmp_path: Path, cache: Path
) -> None:
    manifest = _manifest(tmp_path, in_flight_groups=1)  # one group at a time: the order is the data's
    _run(manifest, tmp_path / "whole", cache, [])
    kills = _kills()
    seen = _run(manifest, tmp_path / "killed", cache, kills)
    whole, killed = _trained(tmp_path / "whole"), _trained(tmp_path / "killed")
    assert killed == whole, f"kills {kills}: {seen}\nwhole  {whole}\nkilled {killed}"
    raw = read_jsonl(tmp_path / "killed" / "metrics.jsonl", raw=True)
    assert sum(r["kind"] == "resume" for r in raw) == 3
    assert any(r.get("redone") for r in raw if r["kind"] == "train"), "no step was redone: a weak test"


def test_killed_three_times_with_groups_in_flight_skips_and_repeats_no_prompt(
    tmp_path: Path, cache: Path
) -> None:
    manifest = _manifest(tmp_path, in_flight_groups=4)
    kills = _kills()
    seen = _run(manifest, tmp_path / "killed", cache, kills)
    trained = Counter(p for step in _trained(tmp_path / "killed") for p in step)
    assert max(trained.values()) == 1, f"{seen}: trained twice: {[p for p, n in trained.items() if n > 1]}"
    state = _final_state(tmp_path / "killed")
    pending = {p for _, p in state.pending_groups}
    assert not pending & set(trained)
    skipped = set(range(state.prompts_consumed)) - set(trained) - pending
    assert skipped == set(), f"{seen}: drawn but neither trained nor pending: {sorted(skipped)}"
    # pending is what the buffer (2 x batch groups, complete groups waiting to be put included) and the
    # groups in flight held at the end, no group left over from an earlier checkpoint. Refill is per
    # sample: each group in flight holds >= 1 of the 8 credits and a new group needs 2, so up to 7.
    assert len(pending) <= 2 * 2 + 2 * 4 - 2, (seen, state.pending_groups)


STALENESS_KEYS = (
    "staleness_s_old_max",
    "staleness_s_old_mean",
    "staleness_s_post_max",
    "staleness_s_post_mean",
    "staleness_delta_gen_max",
    "staleness_delta_gen_mean",
    "staleness_token_weighted_mean",
    "mixed_version_ratio",
)


def test_killed_once_staleness_restarts_from_the_checkpoint_version(tmp_path: Path, cache: Path) -> None:
    """One SIGKILL right after the third step (the checkpoint of step 2 is the latest), then a resume,
    with maxWeightStaleness 1 (groups do get dropped before the crash: the buffer holds 2 steps of data).
    The resumed process's rows (after its `resume` marker) and the run's effective history tell."""
    bound, batch = 1, 2
    manifest = _manifest(tmp_path, in_flight_groups=4, max_staleness=bound)
    run_dir = tmp_path / "killed"
    seen = _run(manifest, run_dir, cache, [(3, 0.0)])
    raw = read_jsonl(run_dir / "metrics.jsonl", raw=True)
    marks = [i for i, r in enumerate(raw) if r["kind"] == "resume"]
    assert len(marks) == 1, (seen, marks)
    k = raw[marks[0]]["step"]  # the checkpoint resumed from; updateInterval 1: its version is k
    assert 2 <= k < STEPS, (seen, k)
    before, after = raw[: marks[0]], raw[marks[0] + 1 :]
    at_checkpoint = next(r for r in before if r["kind"] == "train" and r["step"] == k)

    # the engines hold the checkpoint's version (not 0) before the first group is drawn again
    assert after[0]["kind"] == "update_weights" and after[0]["weight_version"] == k, after[0]
    train = [r for r in after if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(k + 1, STEPS + 1)), seen
    for r in train:
        v_c = r["weight_version"] - 1  # the version published when the step took its groups
        assert r["weight_version"] == r["step"], r  # counted on from the checkpoint's version
        assert all(r[key] >= 0 for key in STALENESS_KEYS), r
        assert r["weight_version_sample_coverage"] == 1.0, r  # the reference engine versions every token
        # every group trained after the resume (the regenerated pending ones first) was generated at
        # version >= k: it lags at most the versions published since the resume
        assert r["staleness_s_old_max"] <= v_c - k, (k, r)
        if v_c - k <= bound:  # no group can be too stale yet: none dropped for the crash's sake
            assert r["stale_groups_filtered"] == at_checkpoint["stale_groups_filtered"], (k, r)
    assert all(train[0][key] == 0.0 for key in STALENESS_KEYS), train[0]  # fresh groups, measured at k

    # the buffer's counters are the run's: continued from the checkpoint, not restarted at 0
    history = read_jsonl(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    assert [r["consumed_groups"] for r in history] == [batch * r["step"] for r in history], seen
    for key in ("stale_groups_filtered", "aborted_groups_filtered", "filtered_groups"):
        values = [r[key] for r in history]
        assert values == sorted(values), (key, values)
