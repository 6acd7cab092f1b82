"""A verifiable reward for numeric answers (GSM8K-style math), with no user code.

Why it exists: the most common RL data users bring is math word problems whose label is a number
(GSM8K writes its solution and ends it with `#### 72`). The reward reads the model's final answer
and compares it numerically with the label: 1.0 when equal, else 0.0.

What counts as the model's final answer, first match wins: the number after the last `####`, the
content of the last `\\boxed{...}`, the number after the last "answer is", else the last number in the
text. Numbers may carry thousands separators, a leading `$`, a trailing `%` or `.`, and may be
fractions (`3/4`). Equal means equal within 1e-6 relative (so `72`, `72.0` and `$72` all score).

Who calls it: lockstep.tasks.base (the default reward of a data task whose labels are numbers).
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?(?:/\d+)?%?"
_HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_IS = re.compile(r"answer is[:\s]*(" + _NUMBER + ")", re.IGNORECASE)
_ANY = re.compile(_NUMBER)


def parse_number(text: str) -> Fraction | None:
    """`text` (one number, e.g. "1,234", "$5", "3/4", "12.5%") -> its value; None when it is not one."""
    s = text.strip().rstrip(".").replace(",", "").replace("$", "").removesuffix("%").strip()
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def label_number(label: str) -> Fraction | None:
    """The numeric label of a row: the number after a GSM8K `####`, or the whole label; None if neither."""
    m = _HASHES.findall(label)
    return parse_number(m[-1]) if m else parse_number(label)


def final_answer(response: str) -> Fraction | None:
    """The response's final numeric answer (see the module doc), or None when it states none."""
    for pattern in (_HASHES, _BOXED, _ANSWER_IS):
        found = pattern.findall(response)
        if found:
            value = parse_number(found[-1])
            if value is not None:
                return value
    numbers = _ANY.findall(response)
    return parse_number(numbers[-1]) if numbers else None


def math_reward(response: str, label: str) -> float:
    """1.0 when the response's final answer equals the numeric label (within 1e-6 relative), else 0.0."""
    want, got = label_number(label), final_answer(response)
    if want is None or got is None:
        return 0.0
    return 1.0 if abs(got - want) <= Fraction(1, 10**6) * max(abs(want), Fraction(1)) else 0.0
