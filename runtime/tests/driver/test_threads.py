"""The CPU thread budget of a one-process run (lockstep.driver.threads): table test and the undo."""

from __future__ import annotations

import pytest
import torch
from lockstep.driver.threads import intra_op_threads, share_cpu


@pytest.mark.parametrize(
    ("cores", "workers", "env", "want"),
    [
        (2, 2, {}, 1),  # the example on 2 cores: trainer + 1 engine
        (64, 2, {}, 32),
        (16, 3, {}, 5),  # trainer + 2 engines: floor, never more threads than cores
        (2, 3, {}, 1),  # more workers than cores: at least one thread each
        (2, 1, {}, None),  # one CPU worker (engines on GPU or elsewhere): torch's default
        (2, 0, {}, None),  # nothing computes on the CPU here (a driver with a remote trainer)
        (2, 2, {"OMP_NUM_THREADS": "2"}, None),  # the user chose
        (2, 2, {"OMP_NUM_THREADS": " "}, 1),  # blank is not a choice
    ],
)
def test_intra_op_threads(cores: int, workers: int, env: dict[str, str], want: int | None) -> None:
    assert intra_op_threads(cores, workers, env) == want


def test_share_cpu_sets_and_undoes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    undo = share_cpu(2, cores=4)
    try:
        assert torch.get_num_threads() == 2
    finally:
        undo()
    assert torch.get_num_threads() == before
