"""Tasks: the built-in reverse task (deterministic, disjoint eval split, exact reward) and JSON-lines data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lockstep.tasks import load_task
from lockstep.tasks.digits import EVAL_ITEMS, MAX_DIGITS, MIN_DIGITS, ReverseDigits, _is_eval


def test_items_are_deterministic_by_seed_and_index() -> None:
    a, b = ReverseDigits(seed=3), ReverseDigits(seed=3)
    assert [a.item(i) for i in (0, 7, 500)] == [b.item(i) for i in (0, 7, 500)]
    assert ReverseDigits(seed=4).item(0) != a.item(0) or ReverseDigits(seed=4).item(1) != a.item(1)


def test_golden_item() -> None:
    item = ReverseDigits(seed=0).item(0)
    digits = item.metadata["digits"]
    assert item.messages == ({"role": "user", "content": f"rev {digits}"},)
    assert item.answer == digits[::-1]
    assert MIN_DIGITS <= len(digits) <= MAX_DIGITS and digits.isdigit()


def test_eval_split_is_disjoint_from_train() -> None:
    task = ReverseDigits(seed=0)
    train = {task.item(i, "train").metadata["digits"] for i in range(2000)}
    evals = {task.item(i, "eval").metadata["digits"] for i in range(task.eval_size)}
    assert task.eval_size == EVAL_ITEMS
    assert not train & evals
    assert all(_is_eval(d) for d in evals)


def test_reward_is_exact_match() -> None:
    task = ReverseDigits()
    item = task.item(5)
    assert task.reward(item.answer, item) == 1.0
    assert task.reward(f" {item.answer}\n", item) == 1.0
    assert task.reward(item.answer + "0", item) == 0.0
    assert task.reward("", item) == 0.0


def test_load_task_builtin_and_errors(tmp_path: Path) -> None:
    assert load_task("builtin:reverse", "builtin:reverse").name == "builtin:reverse"
    with pytest.raises(ValueError, match="unknown built-in task 'builtin:sort'; known: builtin:reverse"):
        load_task("builtin:sort")
    with pytest.raises(ValueError, match=r"data\.evalPrompts"):
        load_task("builtin:reverse", "other.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_task(str(tmp_path / "missing.jsonl"))


def test_jsonl_task(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "1+1", "answer": "2"},
        {"messages": [{"role": "user", "content": "2+2"}], "answer": "4", "k": 1},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = load_task(str(path))
    assert task.item(0).messages == ({"role": "user", "content": "1+1"},)
    assert task.item(3).answer == "4" and task.item(3).metadata == {"k": 1}  # cycles
    assert task.reward(" 4 ", task.item(1)) == 1.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_task(str(bad))


def test_toolcalc_is_a_builtin_task() -> None:
    from lockstep.tasks.toolcalc import calc

    task = load_task("builtin:toolcalc", "builtin:toolcalc", seed=2)
    assert task.name == "builtin:toolcalc"
    item = task.item(3)
    assert item == load_task("builtin:toolcalc", seed=2).item(3)  # deterministic by (seed, index)
    (message,) = item.messages
    assert message["content"] == f"calc {item.metadata['expression']}"
    assert item.answer == calc({"expression": item.metadata["expression"]})
    assert task.reward(f" {item.answer}\n", item) == 1.0 and task.reward("no", item) == 0.0
    with pytest.raises(ValueError, match="builtin:reverse, builtin:shell, builtin:toolcalc"):
        load_task("builtin:nope")
