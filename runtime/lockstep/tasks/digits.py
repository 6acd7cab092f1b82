"""The built-in toy task: reverse a short digit string (multi-token answers, exact-match reward).

Why it exists: `lockstep run` must demonstrably learn on 2 CPU cores in minutes. Reversal needs a
multi-token answer (3 to 5 digits, then the end-of-turn token), is verifiable exactly, cannot be
solved by copying the prompt, and a 2-layer model can learn it (attention looks up the mirrored
position). Prompt: the user message "rev 3841"; answer "1483".

Items are deterministic by (seed, index). The eval split is disjoint from train: a digit string
belongs to eval exactly when a fixed hash of it is 0 mod 8, so eval strings are never trained on.

Reward: 1.0 for the exact reversed string (whitespace stripped), else 0.0; no partial credit, so
the mean reward is the exact-match accuracy.

Who calls it: lockstep.tasks.base.load_task for `builtin:reverse`.
"""

from __future__ import annotations

import random
import zlib

from lockstep.tasks.base import Split, TaskItem, exact_match

MIN_DIGITS = 3
"""Shortest digit string."""
MAX_DIGITS = 5
"""Longest digit string."""
EVAL_ITEMS = 64
"""Size of the eval split."""


def _is_eval(digits: str) -> bool:
    return zlib.crc32(digits.encode()) % 8 == 0


class ReverseDigits:
    """`builtin:reverse`: reverse a string of MIN_DIGITS..MAX_DIGITS digits."""

    def __init__(self, seed: int = 0) -> None:
        self.name = "builtin:reverse"
        self.seed = seed

    @property
    def eval_size(self) -> int:
        return EVAL_ITEMS

    def _digits(self, index: int, split: Split) -> str:
        # A private RNG per (seed, split, index): items never depend on call order.
        rng = random.Random(f"{self.seed}:{split}:{index}")
        while True:
            n = rng.randint(MIN_DIGITS, MAX_DIGITS)
            s = "".join(rng.choice("0123456789") for _ in range(n))
            if _is_eval(s) == (split == "eval"):
                return s

    def item(self, index: int, split: Split = "train") -> TaskItem:
        if index < 0:
            raise ValueError(f"item index must be >= 0, got {index}")
        s = self._digits(index, split)
        # `label`: the task name, the route of on-policy distillation (spec.algorithm.opd.labelKey).
        return TaskItem(
            index, ({"role": "user", "content": f"rev {s}"},), s[::-1], {"digits": s, "label": "reverse"}
        )

    def reward(self, response: str, item: TaskItem) -> float:
        return exact_match(response, item.answer)
