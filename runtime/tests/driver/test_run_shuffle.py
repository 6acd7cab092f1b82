"""`lockstep run` on a JSON-lines prompt file honours spec.data.shuffle, and a resume draws what an
uninterrupted run draws.

5 rows, 2 prompts a step: 4 steps cross an epoch boundary. A reward function records which row each
drawn prompt (data position `item_index`) came from. The uninterrupted run sees every row once in
the first epoch, not in file order; a run stopped after step 2 and resumed to step 4 draws the same
rows at the same positions.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from lockstep.cli import main
from lockstep.tasks.digits import ReverseDigits

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-fast.yaml"
ROWS = 5

RECORDER = """
import json, os

def record(sample, response):
    with open(os.environ["SHUFFLE_TEST_LOG"], "a") as f:
        f.write(json.dumps([sample.metadata["item_index"], sample.metadata["row"]]) + "\\n")
    return 0.1 * sample.index
"""


@pytest.fixture
def recorder(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "lockstep_shuffle_recorder.py").write_text(textwrap.dedent(RECORDER))
    sys.path.insert(0, str(tmp_path))
    yield "lockstep_shuffle_recorder"
    sys.path.remove(str(tmp_path))
    sys.modules.pop("lockstep_shuffle_recorder", None)


def _manifest(tmp_path: Path, recorder: str) -> Path:
    task = ReverseDigits(0)  # prompts the tiny model's tokenizer can render
    rows = [
        {"messages": list(task.item(i).messages), "answer": task.item(i).answer, "row": i}
        for i in range(ROWS)
    ]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["data"] = {"prompts": str(data), "seed": 3}  # shuffle: true is the default
    doc["spec"]["agent"] = {"rewardFunction": f"{recorder}:record"}
    doc["spec"]["schedule"]["saveInterval"] = 1
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _drawn(log: Path) -> dict[int, int]:
    """data position -> row, from the recorder's log."""
    out: dict[int, int] = {}
    for line in log.read_text().splitlines():
        position, row = json.loads(line)
        assert out.setdefault(position, row) == row
    return out


def test_shuffled_prompts_resume_where_they_stopped(
    tmp_path: Path, recorder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = _manifest(tmp_path, recorder)
    cache = str(tmp_path / "cache")
    whole, split = tmp_path / "whole.log", tmp_path / "split.log"

    monkeypatch.setenv("SHUFFLE_TEST_LOG", str(whole))
    args = ["run", str(manifest), "--run-dir", str(tmp_path / "a"), "--cache-dir", cache]
    assert main([*args, "--steps", "4"]) == 0
    uninterrupted = _drawn(whole)
    assert sorted(uninterrupted) == list(range(8))
    first_epoch = [uninterrupted[i] for i in range(ROWS)]
    assert sorted(first_epoch) == list(range(ROWS))  # every row once per epoch
    assert first_epoch != list(range(ROWS))  # shuffled, not file order

    monkeypatch.setenv("SHUFFLE_TEST_LOG", str(split))
    args = ["run", str(manifest), "--run-dir", str(tmp_path / "b"), "--cache-dir", cache]
    assert main([*args, "--steps", "2"]) == 0
    assert main([*args, "--steps", "4", "--resume"]) == 0
    assert _drawn(split) == uninterrupted
