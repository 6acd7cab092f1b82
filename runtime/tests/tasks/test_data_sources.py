"""User prompt data: JSON-lines files and directories, local Hugging Face datasets (saved to disk and
data files), row errors naming the row and the field, and the math reward that makes a GSM8K-style
file work without user code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lockstep.tasks import load_task
from lockstep.tasks.base import DataTask
from lockstep.tasks.numeric import final_answer, label_number, math_reward

GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
        "May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72",
    },
    {"question": "What is 1,000 + 234?", "answer": "#### 1,234"},
]


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("48 + 24 = 72, so the answer is 72.", 1.0),
        ("Reasoning... #### 72", 1.0),
        ("The total is \\boxed{72}", 1.0),
        ("$72.00", 1.0),
        ("She sold 72 clips, then 3 more", 0.0),  # the last number is the final answer
        ("I do not know", 0.0),
        ("The answer is 71", 0.0),
    ],
)
def test_math_reward_reads_the_final_number(response: str, score: float) -> None:
    assert math_reward(response, GSM8K_ROWS[0]["answer"]) == score


def test_numbers_parse_in_the_forms_people_write() -> None:
    assert label_number("#### 1,234") == 1234 and label_number("3/4") * 4 == 3  # type: ignore[operator]
    assert label_number("seventy-two") is None
    assert final_answer("so 12.5% of it") == label_number("12.5")


def test_a_gsm8k_style_file_works_without_user_code(tmp_path: Path) -> None:
    task = load_task(str(_write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)))
    assert isinstance(task, DataTask) and task.reward_kind == "math"
    item = task.item(0)
    assert item.messages == ({"role": "user", "content": GSM8K_ROWS[0]["question"]},)
    assert task.reward("The answer is 72.", item) == 1.0 and task.reward("73", item) == 0.0
    assert task.reward("#### 1234", task.item(1)) == 1.0


def test_text_labels_keep_exact_match(tmp_path: Path) -> None:
    rows = [{"prompt": "capital of France?", "answer": "Paris"}, {"prompt": "1+1", "answer": 2}]
    task = load_task(str(_write_jsonl(tmp_path / "p.jsonl", rows)))
    assert isinstance(task, DataTask) and task.reward_kind == "exact"
    assert task.reward(" Paris\n", task.item(0)) == 1.0 and task.reward("paris", task.item(0)) == 0.0


def test_a_directory_of_jsonl_files_is_read_in_name_order(tmp_path: Path) -> None:
    d = tmp_path / "data"
    d.mkdir()
    _write_jsonl(d / "b.jsonl", [{"prompt": "second", "answer": "2"}])
    _write_jsonl(d / "a.jsonl", [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "first"}], "label": 1}])  # fmt: skip
    task = load_task(str(d))
    assert [task.item(i).messages[-1]["content"] for i in range(2)] == ["first", "second"]
    assert task.item(0).answer == "1"


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"prompt": "x"}, r'each row needs "messages".*"answer"'),
        ({"messages": [{"role": "robot", "content": "x"}], "answer": "1"}, r"messages\[0\] must be"),
        ({"prompt": ["x"], "answer": "1"}, r'"prompt" must be a string'),
        ({"prompt": "x", "answer": {"a": 1}}, r'"answer" must be a string or a number'),
    ],
)
def test_bad_rows_name_the_file_line_and_field(tmp_path: Path, row: dict[str, object], match: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": "1"}, row])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: " + match):
        load_task(str(path))


def test_local_hugging_face_datasets(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "gsm8k"
    ds = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(GSM8K_ROWS), "test": datasets.Dataset.from_list(GSM8K_ROWS[1:])}
    )
    ds.save_to_disk(str(saved))
    task = load_task(str(saved), f"{saved}:test")
    assert task.item(0).messages[0]["content"].startswith("Natalia") and task.eval_size == 1
    assert task.reward("#### 1234", task.item(0, "eval")) == 1.0
    with pytest.raises(ValueError, match=r"no split 'dev'.*:SPLIT"):
        load_task(f"{saved}:dev")
    files = tmp_path / "parquet"
    files.mkdir()
    datasets.Dataset.from_list(GSM8K_ROWS).to_parquet(str(files / "part-0.parquet"))
    task = load_task(str(files))
    assert task.item(1).answer == "#### 1,234" and task.reward("1234", task.item(1)) == 1.0
