"""The toolcalc environment: deterministic items, the `calc` tool, and the reward.

Items: "calc A+B" (or -, *) with A, B in 0..99, deterministic by (seed, split, index); the answer is
the integer result. The tool `calc` takes {"expression": "A+B"} and returns the result as text (a
safe evaluator over + - * and integers; anything else returns an error string, as a real tool would).

Reward (what `score` computes from an episode, in [0, 1]):
  1.0  the agent called calc and its final answer equals the result;
  0.2  the agent made a well-formed calc call but answered wrong (shaping for a random policy);
  0.0  otherwise.

Who calls it: lockstep.tasks.toolcalc.agent (runs the tool, scores), the driver (reward function
named in the manifest), tests.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable, Mapping
from typing import Any

from lockstep.tasks.base import Split, TaskItem

CALC_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an integer arithmetic expression with + - *.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12+7"}},
            "required": ["expression"],
        },
    },
}
"""The OpenAI tool schema of `calc` (agents pass it in `tools`)."""

_OPS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}
EVAL_ITEMS = 32
"""Size of the eval split."""


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError("only integers and + - * are supported")


def calc(arguments: Mapping[str, Any]) -> str:
    """The tool: evaluate arguments["expression"]; errors come back as text, never raise."""
    expr = arguments.get("expression")
    if not isinstance(expr, str) or len(expr) > 64:
        return "error: pass expression as a short string, e.g. 12+7"
    try:
        return str(_eval(ast.parse(expr, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as exc:
        return f"error: {exc}"


class ToolCalc:
    """The toolcalc task (the lockstep.tasks.Task contract)."""

    def __init__(self, seed: int = 0) -> None:
        self.name = "builtin:toolcalc"
        self.seed = seed

    @property
    def eval_size(self) -> int:
        return EVAL_ITEMS

    def item(self, index: int, split: Split = "train") -> TaskItem:
        if index < 0:
            raise ValueError(f"item index must be >= 0, got {index}")
        rng = random.Random(f"toolcalc:{self.seed}:{split}:{index}")
        a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-*")
        expr = f"{a}{op}{b}"
        return TaskItem(
            index,
            ({"role": "user", "content": f"calc {expr}"},),
            calc({"expression": expr}),
            {"expression": expr, "label": "toolcalc"},  # label: the OPD route (the task's name)
        )

    def reward(self, response: str, item: TaskItem) -> float:
        # Without a transcript only the final text is known: exact match of the answer.
        return 1.0 if response.strip() == item.answer else 0.0


def score(called_calc: bool, well_formed: bool, final_answer: str, answer: str) -> float:
    """The episode reward (see the module docstring)."""
    if called_calc and final_answer.strip() == answer.strip():
        return 1.0
    if well_formed:
        return 0.2
    return 0.0


def reward(sample: Any, response: str) -> float:
    """RewardFn for the manifest: reads the episode summary the agent stored in sample.metadata."""
    ep = sample.metadata.get("toolcalc")
    answer = str(sample.metadata.get("answer", ""))
    if not isinstance(ep, dict):
        return 1.0 if response.strip() == answer.strip() else 0.0
    return score(bool(ep["called_calc"]), bool(ep["well_formed"]), str(ep["final"]), answer)
