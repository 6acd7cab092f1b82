"""`lockstep run` with on-policy distillation, end to end on the tiny model (docs/distillation.md).

Real reference engines on 127.0.0.1 (the student's and each checkpoint teacher's), the FSDP trainer:
- a teacher that is the student's own checkpoint, with true on-policy kernels: d_t == 0 exactly on
  every token of the first step (before the student has moved);
- two teachers routed by the `label` column of a JSON-lines prompt file: both get samples, each is
  reported; a label no teacher lists stops the run with exit 2, naming the label;
- a candidate set (union of top-K), fully-async, and TITO agent sessions (multi-turn rows with tool
  tokens) all run through the same scorer and report per step;
- a poolRef teacher (a standalone pool, served in a cluster only) stops the run with exit 2 naming the
  fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.cli import main
from lockstep.observability.metrics import read_jsonl

pytestmark = pytest.mark.heavy  # whole runs (docs/engineering.md: `make check` leaves them out)

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-fast.yaml"
TOOLS = Path(__file__).parents[1] / "session" / "fixtures" / "tiny-tools.yaml"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _manifest(tmp_path: Path, edit: dict[str, Any], base: Path = FIXTURE) -> Path:
    doc = yaml.safe_load(base.read_text())
    for dotted, value in edit.items():
        node = doc
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _run(
    tmp_path: Path, cache: Path, edit: dict[str, Any], steps: int, base: Path = FIXTURE
) -> list[dict[str, Any]]:
    run_dir = tmp_path / "run"
    code = main(["run", str(_manifest(tmp_path, edit, base)), "--run-dir", str(run_dir), "--cache-dir", str(cache),
                 "--steps", str(steps)])  # fmt: skip
    assert code == 0
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


SELF = {"teachers": [{"name": "self", "checkpoint": "builtin:tiny"}], "defaultTeacher": "self"}


def test_a_teacher_that_is_the_student_gives_exactly_zero_with_true_on_policy(
    tmp_path: Path, cache: Path
) -> None:
    rows = _run(
        tmp_path,
        cache,
        {
            "spec.algorithm.sftWarmStart": None,
            "spec.algorithm.trueOnPolicy": True,
            "spec.algorithm.opd": SELF,
        },
        steps=2,
    )
    first = rows[0]
    assert first["opd_tokens_scored"] > 0 and first["opd_self_samples"] == 8.0
    assert first["opd_logratio_abs_max"] == 0.0  # every token of step 1: d_t == 0, exactly
    assert first["train_rollout_logprob_abs_diff"] == 0.0
    assert first["opd_teacher_latency_s_mean"] > 0 and first["opd_teacher_computed_tokens"] > 0
    # Nothing to learn: no task reward yet (the base model) and d_t = 0, so every advantage is 0 and the
    # student stays the teacher, exactly, at step 2 too.
    assert first["advantage_abs_mean"] == 0.0 and rows[1]["opd_logratio_abs_max"] == 0.0


def _labelled_prompts(path: Path, labels: list[str]) -> Path:
    with path.open("w") as f:
        for i, label in enumerate(labels * 4):
            digits = f"{100 + 37 * i}"
            f.write(json.dumps({"prompt": f"rev {digits}", "answer": digits[::-1], "label": label}) + "\n")
    return path


TWO = {
    "teachers": [
        {"name": "alpha", "checkpoint": "builtin:tiny", "labels": ["a"]},
        {"name": "beta", "checkpoint": "builtin:tiny-deep", "labels": ["b"]},
    ]
}


def test_two_teachers_each_get_their_label(tmp_path: Path, cache: Path) -> None:
    prompts = _labelled_prompts(tmp_path / "p.jsonl", ["a", "b"])
    edit = {"spec.data.prompts": str(prompts), "spec.data.shuffle": False, "spec.algorithm.opd": TWO}
    [row] = _run(tmp_path, cache, edit, steps=1)
    assert row["opd_alpha_samples"] == 4.0 and row["opd_beta_samples"] == 4.0  # 2 groups: one a, one b
    assert (
        row["opd_alpha_tokens"] > 0 and "opd_beta_logratio_mean" in row and "opd_alpha_logratio_mean" in row
    )


def test_an_unrouted_label_stops_the_run_naming_it(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = _labelled_prompts(tmp_path / "p.jsonl", ["a", "zz"])
    edit = {"spec.data.prompts": str(prompts), "spec.data.shuffle": False, "spec.algorithm.opd": TWO}
    code = main(["run", str(_manifest(tmp_path, edit)), "--run-dir", str(tmp_path / "run"),
                 "--cache-dir", str(cache), "--steps", "1"])  # fmt: skip
    assert code == 2
    assert "label 'zz'" in capsys.readouterr().err


def test_a_pool_ref_teacher_stops_lockstep_run_naming_the_fix(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    opd = {"teachers": [{"name": "tutor", "poolRef": {"name": "tutor"}}], "defaultTeacher": "tutor"}
    run_dir = tmp_path / "run"
    code = main(["run", str(_manifest(tmp_path, {"spec.algorithm.opd": opd})), "--run-dir", str(run_dir),
                 "--cache-dir", str(cache), "--steps", "1"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "teachers[tutor].poolRef: a standalone pool is reached through the cluster" in err, err
    assert "give the teacher a url or a checkpoint" in err


def test_a_candidate_set_runs_and_reports_its_cost(tmp_path: Path, cache: Path) -> None:
    opd = {**SELF, "candidates": {"set": "union", "topK": 4, "weight": "student"}, "taskReward": "zero"}
    [row] = _run(tmp_path, cache, {"spec.algorithm.opd": opd}, steps=1)
    assert row["opd_candidate_set_size_mean"] >= 4.0
    assert row["opd_student_computed_tokens"] > 0 and row["opd_teacher_reply_bytes"] > 0
    assert row["reward_mean"] == 0.0 and "task_reward_mean" in row  # pure distillation: reward zeroed


def test_fully_async_reports_opd_every_step(tmp_path: Path, cache: Path) -> None:
    edit = {"spec.algorithm.opd": SELF, "spec.schedule.mode": "fully-async", "spec.rollout.maxInFlight": 8}
    rows = _run(tmp_path, cache, edit, steps=2)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["opd_tokens_scored"] > 0 and r["opd_samples_scored"] > 0 for r in rows)


def test_tito_sessions_are_scored_on_their_stored_rows(tmp_path: Path, cache: Path) -> None:
    opd = {"teachers": [{"name": "calc", "checkpoint": "builtin:tiny"}], "defaultTeacher": "calc"}
    rows = _run(tmp_path, cache, {"spec.algorithm.opd": opd, "spec.schedule.steps": 1}, steps=1, base=TOOLS)
    row = rows[0]
    assert row["opd_calc_samples"] > 0
    # Only the policy's own tokens are scored and trained; tool results (loss mask 0) are not.
    assert row["opd_tokens_scored"] == row["opd_teacher_tokens"] == row["train_tokens"]
