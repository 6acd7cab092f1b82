"""spec.data.shuffle: user prompts come in a new seeded order every epoch, a pure function of the data
position, so a resumed run draws what an uninterrupted one draws (the driver-level check is in
runtime/tests/driver/test_run_shuffle.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lockstep.api import DataSpec
from lockstep.tasks import data_task, load_task
from lockstep.tasks.base import epoch_order

N = 7


def _data(tmp_path: Path, n: int = N) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(n)))
    return str(path)


def _drawn(task: object, start: int, count: int) -> list[str]:
    return [task.item(i).answer for i in range(start, start + count)]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("n", "seed", "epoch"),
    [(1, 0, 0), (2, 0, 0), (7, 0, 0), (7, 0, 1), (7, 3, 0), (1000, 12345, 9)],
)
def test_every_epoch_is_a_permutation(n: int, seed: int, epoch: int) -> None:
    order = epoch_order(n, seed, epoch)
    assert sorted(order) == list(range(n))
    assert order == epoch_order(n, seed, epoch)  # a function of its arguments only


def test_epochs_and_seeds_give_different_orders() -> None:
    orders = {epoch_order(1000, seed, epoch) for seed in (0, 1) for epoch in (0, 1, 2)}
    assert len(orders) == 6 and tuple(range(1000)) not in orders


def test_shuffle_reorders_each_epoch_and_covers_every_row(tmp_path: Path) -> None:
    task = data_task(DataSpec(prompts=_data(tmp_path), seed=5))  # shuffle defaults to true
    epochs = [_drawn(task, e * N, N) for e in range(3)]
    for drawn in epochs:
        assert sorted(drawn) == sorted(str(i) for i in range(N))  # each row once per epoch
    assert len({tuple(d) for d in epochs}) == 3 and [str(i) for i in range(N)] not in epochs
    assert [task.item(i).index for i in range(N, 2 * N)] == list(range(N, 2 * N))  # the data position


def test_resuming_at_any_position_draws_the_same_prompts(tmp_path: Path) -> None:
    source = _data(tmp_path)
    uninterrupted = _drawn(data_task(DataSpec(prompts=source, seed=9)), 0, 3 * N)
    for k in range(3 * N):  # a new process (fresh task) resumed at data position k
        assert _drawn(data_task(DataSpec(prompts=source, seed=9)), k, 3 * N - k) == uninterrupted[k:]


def test_no_shuffle_keeps_file_order_and_seeds_matter(tmp_path: Path) -> None:
    source = _data(tmp_path)
    assert _drawn(data_task(DataSpec(prompts=source, shuffle=False)), 0, 2 * N) == [
        str(i % N) for i in range(2 * N)
    ]
    assert _drawn(load_task(source), 0, N) == [str(i) for i in range(N)]  # load_task alone: file order
    one, two = (_drawn(data_task(DataSpec(prompts=source, seed=s)), 0, N) for s in (1, 2))
    assert one != two


def test_the_eval_split_keeps_its_order(tmp_path: Path) -> None:
    task = data_task(DataSpec(prompts=_data(tmp_path), seed=5))
    assert [task.item(i, "eval").answer for i in range(N)] == [str(i) for i in range(N)]
