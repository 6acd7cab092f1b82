"""metrics.jsonl across a resume: the redone steps are marked, and read as one row per step.

A run killed after logging step 5 resumes from its step-4 checkpoint and redoes step 5: the file keeps
both rows (nothing written is lost), the new one carries `redone`, a `resume` marker sits between them,
and read_jsonl (the plots, the sweeps) returns steps 1..6 once each, the redone row of step 5.
"""

from __future__ import annotations

from pathlib import Path

from lockstep.observability.metrics import MetricsSink, read_jsonl


def test_a_resumed_run_supersedes_the_steps_it_redoes(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    first = MetricsSink(path)
    first.resumed(-1)  # a fresh file: no marker
    for step in range(1, 6):
        first.log("train", step, {"loss": float(step)})
    first.record("data", 5, {"positions": [9, 8]})
    first.close()  # killed here; the checkpoint is step 4
    second = MetricsSink(path)
    second.resumed(4)
    for step in (5, 6):
        second.log("train", step, {"loss": 10.0 * step})
    second.close()
    rows = read_jsonl(path, "train")
    assert [(r["step"], r["loss"]) for r in rows] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 4.0),
        (5, 50.0),
        (6, 60.0),
    ]
    assert [r.get("redone") for r in rows] == [None, None, None, None, 1.0, None]
    assert read_jsonl(path, "data") == []  # the killed run's step-5 data row went with its step
    raw = read_jsonl(path, raw=True)
    assert [r["kind"] for r in raw].count("resume") == 1 and len(raw) == 9


def test_a_start_over_supersedes_everything(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    first = MetricsSink(path)
    first.log("sft", 1, {"loss": 1.0})
    first.close()  # killed before the first checkpoint: the next run starts over
    second = MetricsSink(path)
    second.resumed(-1)
    second.log("sft", 1, {"loss": 2.0})
    second.close()
    assert [r["loss"] for r in read_jsonl(path, "sft")] == [2.0]
