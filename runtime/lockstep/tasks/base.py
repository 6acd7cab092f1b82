"""The Task contract and the loader that turns a manifest's prompt source into a Task.

Why it exists: one small protocol lets the driver treat built-in toy tasks and user JSON-lines data
the same way: `item(index, split)` gives a deterministic prompt, `reward(text, item)` scores an answer.

Who calls it: lockstep.driver.components (load_task on data.prompts / data.evalPrompts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

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


class JsonlTask:
    """A task read from a JSON-lines file: {"prompt": str} or {"messages": [...]}, plus "answer"."""

    def __init__(self, path: Path, eval_path: Path | None = None) -> None:
        self.name = str(path)
        self._train = _read_jsonl(path)
        self._eval = (
            _read_jsonl(eval_path) if eval_path is not None else self._train[: min(64, len(self._train))]
        )

    @property
    def eval_size(self) -> int:
        return len(self._eval)

    def item(self, index: int, split: Split = "train") -> TaskItem:
        rows = self._train if split == "train" else self._eval
        row = rows[index % len(rows)]
        return TaskItem(index, row[0], row[1], row[2])

    def reward(self, response: str, item: TaskItem) -> float:
        return exact_match(response, item.answer)


def _read_jsonl(path: Path) -> list[tuple[tuple[dict[str, str], ...], str, dict[str, Any]]]:
    if not path.is_file():
        raise FileNotFoundError(
            f"prompt file {path} does not exist; give a JSON-lines file or builtin:<task>"
        )
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if "answer" not in obj or not ("prompt" in obj or "messages" in obj):
            raise ValueError(f'{path}:{n}: each line needs "answer" and "prompt" or "messages"')
        msgs = obj.get("messages") or [{"role": "user", "content": obj["prompt"]}]
        meta = {k: v for k, v in obj.items() if k not in ("prompt", "messages", "answer")}
        rows.append((tuple(msgs), str(obj["answer"]), meta))
    if not rows:
        raise ValueError(f"prompt file {path} holds no items")
    return rows
