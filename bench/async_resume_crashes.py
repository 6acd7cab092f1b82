"""Figure: prompts skipped or trained twice after N crashes of a fully-async run (goal 0).

Why it exists: a fully-async run draws prompts ahead of training (its buffer and the groups in flight);
frameworks that checkpoint only the draw position skip those prompts on every resume. Lockstep's
checkpoints carry them (DriverState.pending_groups). This runs the fully-async example as real
`lockstep run` processes, kills each with SIGKILL at N random points, resumes, and counts from
metrics.jsonl (`data` rows: the positions each step trained) and the last checkpoint (prompts drawn,
groups pending): prompts skipped (drawn, never trained, not pending) and trained twice. It also counts
what a resume from the draw position alone would have skipped: the groups pending in the checkpoints
the resumes started from. The baseline, in the same run, is the same job uninterrupted.

Run: `.venv/bin/python bench/async_resume_crashes.py [--crashes 1 3 5] [--steps 12]`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml
from lockstep.observability.metrics import read_jsonl
from lockstep.trainer.state import latest_checkpoint

EXAMPLE = Path("examples/tiny-async.yaml")


def _start(manifest: Path, run_dir: Path, cache: Path, resume: bool, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "lockstep", "run", str(manifest), "--run-dir", str(run_dir)]
    cmd += ["--cache-dir", str(cache), *(["--resume"] if resume else [])]
    with log.open("a") as out:
        return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=out)


def _latest_pending(run_dir: Path) -> int:
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return 0
    return len(json.loads((checkpoint / "trainer_state.json").read_text())["extra"].get("pending_groups", []))


def _run(manifest: Path, run_dir: Path, cache: Path, crashes: int, rng: random.Random) -> dict[str, int]:
    log = run_dir.parent / f"{run_dir.name}.log"
    would_skip = 0
    for _ in range(crashes):  # each process is killed after 1-2 steps of its own, plus up to 1.5 s
        before = len(read_jsonl(run_dir / "metrics.jsonl", "train", raw=True))
        proc = _start(manifest, run_dir, cache, latest_checkpoint(run_dir) is not None, log)
        n = rng.randint(1, 2)
        while len(read_jsonl(run_dir / "metrics.jsonl", "train", raw=True)) < before + n:
            if proc.poll() is not None:
                raise SystemExit(f"ended before its kill: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        time.sleep(rng.uniform(0.0, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        would_skip += _latest_pending(run_dir)  # what the next resume would lose without them
    proc = _start(manifest, run_dir, cache, latest_checkpoint(run_dir) is not None, log)
    if proc.wait(timeout=3600) != 0:
        raise SystemExit(log.read_text()[-3000:])
    data = read_jsonl(run_dir / "metrics.jsonl", "data")
    trained = Counter(p for r in data for p in r["positions"])
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None
    extra = json.loads((checkpoint / "trainer_state.json").read_text())["extra"]
    pending = {p for _, p in extra.get("pending_groups", [])}
    drawn = set(range(extra["prompts_consumed"]))
    return {
        "steps": len(data),
        "trained": sum(trained.values()),
        "skipped": len(drawn - set(trained) - pending),
        "twice": sum(n - 1 for n in trained.values() if n > 1),
        "would_skip_without_pending": would_skip,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--crashes", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    doc = yaml.safe_load(EXAMPLE.read_text())
    schedule = doc["spec"]["schedule"]
    schedule |= {"steps": args.steps, "saveInterval": 2}
    for key in ("maxWeightStaleness", "evalInterval"):  # keep every group: the count is the prompts
        schedule.pop(key, None)
    with tempfile.TemporaryDirectory() as tmp:
        manifest, cache = Path(tmp) / "job.yaml", Path(tmp) / "cache"
        manifest.write_text(yaml.safe_dump(doc))
        rows = {}
        for n in [0, *args.crashes]:
            rows[n] = _run(manifest, Path(tmp) / f"crashes{n}", cache, n, rng)
            r = rows[n]
            print(
                f"{n} crash(es): {r['steps']} steps, {r['trained']} prompts trained, skipped {r['skipped']}, "
                f"trained twice {r['twice']}; a resume from the draw position alone would have skipped "
                f"{r['would_skip_without_pending']}",
                flush=True,
            )
    base = rows[0]
    worst = max(rows[n]["skipped"] + rows[n]["twice"] for n in args.crashes)
    print(f"\nbaseline (uninterrupted): skipped {base['skipped']}, twice {base['twice']}; "
          f"worst after crashes: {worst} (goal 0)")  # fmt: skip


if __name__ == "__main__":
    main()
