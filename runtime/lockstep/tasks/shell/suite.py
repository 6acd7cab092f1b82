"""`builtin:shell`: a small suite of one-command shell tasks the tiny model can learn.

Why it exists: the sandbox path needs an example that learns on 2 CPU cores in minutes, so each task
is solved by one short command derived from the instruction by copying names (the tiny model is a
character model with ~0.1M parameters): make a file or a directory, write a number to a file,
remove, copy or move a file. Every task has a setup script where the environment needs one, a test
script that checks the resulting state (and fails when the model did nothing or the wrong thing), and
its reference solution (the SFT warm start imitates it; tests run every kind's solution and a wrong
command in a real sandbox).

Items are deterministic by (seed, split, index); file names are single lowercase letters and the
numbers single digits (longer names made the copy the tiny model must learn too slow to screen on 2
cores: after an SFT warm start to loss 0.2, 2-3 letter names gave a sampled reward of ~0.01). The eval split is disjoint from train: an instruction belongs to eval exactly when a fixed
hash of it is 0 mod 8. `rows()` writes the same items as JSON-lines rows (examples/data/shell-tasks.jsonl
is that file: the form user data takes).

Who calls it: lockstep.tasks.registry (`builtin:shell`), tests, bench.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from lockstep.tasks.base import Split, TaskItem
from lockstep.tasks.shell.rows import reward as _test_reward
from lockstep.tasks.shell.rows import task_row

EVAL_ITEMS = 32
"""Size of the eval split."""
LETTERS = "abcdefghijklmnopqrstuvwxyz"

Spec = tuple[str, str | None, str, str]
"""(instruction, setup, test, solution) of one task."""


def _touch(a: str, b: str, n: str) -> Spec:
    return f"make file {a}", None, f"[ -f {a} ]", f"touch {a}"


def _mkdir(a: str, b: str, n: str) -> Spec:
    return f"make dir {a}", None, f"[ -d {a} ]", f"mkdir {a}"


def _write(a: str, b: str, n: str) -> Spec:
    return f"write {n} to {a}", None, f'[ "$(cat {a})" = "{n}" ]', f"echo {n} > {a}"


def _remove(a: str, b: str, n: str) -> Spec:
    return f"remove {a}", f"echo {n} > {a}", f"[ ! -e {a} ]", f"rm {a}"


def _copy(a: str, b: str, n: str) -> Spec:
    return f"copy {a} to {b}", f"echo {n} > {a}", f'[ "$(cat {b})" = "{n}" ] && [ -f {a} ]', f"cp {a} {b}"


def _move(a: str, b: str, n: str) -> Spec:
    return f"move {a} to {b}", f"echo {n} > {a}", f'[ "$(cat {b})" = "{n}" ] && [ ! -e {a} ]', f"mv {a} {b}"


KINDS: dict[str, Callable[[str, str, str], Spec]] = {
    "touch": _touch,
    "mkdir": _mkdir,
    "write": _write,
    "remove": _remove,
    "copy": _copy,
    "move": _move,
}
"""The task kinds, by name."""


def _is_eval(instruction: str) -> bool:
    return zlib.crc32(instruction.encode()) % 8 == 0


def task(seed: int, split: Split, index: int) -> tuple[str, Spec]:
    """The kind and spec of item `index` of `split` (pure)."""
    rng = random.Random(f"shell:{seed}:{split}:{index}")
    while True:
        kind = rng.choice(sorted(KINDS))
        a, b = rng.sample(LETTERS, 2)
        n = str(rng.randint(1, 9))
        spec = KINDS[kind](a, b, n)
        if _is_eval(spec[0]) == (split == "eval"):
            return kind, spec


def row(seed: int, split: Split, index: int) -> dict[str, Any]:
    """Item `index` as a JSON-lines row (the user-data form)."""
    kind, (instruction, setup, test, solution) = task(seed, split, index)
    out: dict[str, Any] = {"instruction": instruction, "test": test, "solution": solution, "kind": kind}
    if setup is not None:
        out["setup"] = setup
    return out


def rows(seed: int, split: Split, n: int) -> Iterator[dict[str, Any]]:
    """The first `n` items of `split` as rows."""
    return (row(seed, split, i) for i in range(n))


class ShellSuite:
    """`builtin:shell` (the lockstep.tasks.Task contract); run it with spec.agent.sandbox set."""

    def __init__(self, seed: int = 0) -> None:
        self.name = "builtin:shell"
        self.seed = seed

    @property
    def eval_size(self) -> int:
        return EVAL_ITEMS

    def item(self, index: int, split: Split = "train") -> TaskItem:
        if index < 0:
            raise ValueError(f"item index must be >= 0, got {index}")
        r = task_row(row(self.seed, split, index), f"builtin:shell[{split}][{index}]")
        return TaskItem(index, r.messages, r.answer, dict(r.metadata))

    def reward(self, response: str, item: TaskItem) -> float:
        # The verdict is the test script's, which only the episode knows (lockstep.tasks.shell.reward
        # reads it from the sample); without an episode there is nothing to score.
        return 0.0


reward = _test_reward
"""The suite's reward function (the test script's verdict), for spec.agent.rewardFunction."""


if __name__ == "__main__":  # `python -m lockstep.tasks.shell.suite > examples/data/shell-tasks.jsonl`
    import json
    import sys

    for r in rows(0, "train", 128):
        sys.stdout.write(json.dumps(r) + "\n")
