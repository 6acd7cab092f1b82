"""The Task contract and the loader that turns a manifest's prompt source into a Task.

Why it exists: one small protocol lets the driver treat built-in toy tasks and user data (JSON lines,
local Hugging Face datasets) the same way: `item(index, split)` gives a deterministic prompt,
`reward(text, item)` scores an answer.

Who calls it: lockstep.driver.components (load_task on data.prompts / data.evalPrompts).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, Protocol

from lockstep.tasks.numeric import label_number, math_reward

Split = Literal["train", "eval"]
"""Which part of a task: training prompts or held-out evaluation prompts."""


@dataclass(frozen=True, slots=True)
class TaskItem:
    """One prompt of a task and what its reward needs."""

    index: int
    """Position of the item in its split (the data position of a run counts these)."""
    messages: tuple[dict[str, str], ...]
    """Chat messages of the prompt ({"role", "content"}); rendered with the family's chat format."""
    answer: str
    """The reference answer."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Extra data for custom reward functions (copied into Sample.metadata with the answer)."""


class Task(Protocol):
    """A verifiable task: deterministic prompts by index and a reward in [0, 1]."""

    name: str
    """Task name as given in the manifest (e.g. builtin:reverse)."""

    def item(self, index: int, split: Split = "train") -> TaskItem:
        """The index-th item of `split`; the train split cycles forever, eval has `eval_size` items."""
        ...

    @property
    def eval_size(self) -> int:
        """Number of items of the eval split."""
        ...

    def reward(self, response: str, item: TaskItem) -> float:
        """Score the decoded response text (special tokens removed) against the item."""
        ...


def exact_match(response: str, answer: str) -> float:
    """1.0 when the stripped response equals the stripped answer, else 0.0."""
    return 1.0 if response.strip() == answer.strip() else 0.0


@lru_cache(maxsize=2)
def epoch_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The row order of train epoch `epoch` (of `n` rows) under spec.data.seed `seed` (pure).

    Each epoch is its own permutation, a function of (seed, epoch) only: item `i` of a run is row
    `epoch_order(n, seed, i // n)[i % n]`, so a run resumed at data position k draws exactly the
    prompts an uninterrupted run draws from k on (the position is in every checkpoint), and every
    row is seen once per epoch. Two epochs are cached (the current one and its neighbour).
    """
    order = list(range(n))
    random.Random(f"lockstep-data:{seed}:{epoch}").shuffle(order)
    return tuple(order)


class DataTask:
    """A task over user data (lockstep.tasks.data reads it): rows of chat messages and a label.

    The default reward is `math` (lockstep.tasks.numeric: the final number equals the label) when every
    label of the train rows is a number (GSM8K's `#### 72` included), else exact match. With
    `shuffle_seed` (spec.data.shuffle, seeded by spec.data.seed) the train rows come in a new order
    every epoch (epoch_order); without it, in file order. The eval split keeps its order.
    """

    def __init__(
        self, name: str, train: list[Row], eval_rows: list[Row] | None = None, shuffle_seed: int | None = None
    ) -> None:
        self.name = name
        self.shuffle_seed = shuffle_seed
        """spec.data.seed when spec.data.shuffle, else None (file order)."""
        self._train = train
        self._eval = eval_rows if eval_rows is not None else train[: min(64, len(train))]
        self.reward_kind: Literal["math", "exact"] = (
            "math" if all(label_number(r.answer) is not None for r in train) else "exact"
        )
        """Which default reward scores this task's answers."""

    @property
    def eval_size(self) -> int:
        return len(self._eval)

    def item(self, index: int, split: Split = "train") -> TaskItem:
        if split == "eval":
            row = self._eval[index % len(self._eval)]
        else:
            n = len(self._train)
            pos = index % n
            if self.shuffle_seed is not None:
                pos = epoch_order(n, self.shuffle_seed, index // n)[pos]
            row = self._train[pos]
        return TaskItem(index, row.messages, row.answer, dict(row.metadata))

    def reward(self, response: str, item: TaskItem) -> float:
        if self.reward_kind == "math":
            return math_reward(response, item.answer)
        return exact_match(response, item.answer)


@dataclass(frozen=True, slots=True)
class Row:
    """One prompt of user data, validated (lockstep.tasks.data builds them)."""

    messages: tuple[dict[str, str], ...]
    """The prompt as chat messages."""
    answer: str
    """The label the reward reads."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Every other column of the row (for custom reward functions)."""
