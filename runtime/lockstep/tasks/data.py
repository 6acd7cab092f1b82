"""Prompt data from JSON-lines files and local Hugging Face datasets, read into validated rows.

Why it exists: users bring their prompts as JSON lines or as datasets saved with the `datasets`
library; both become the same rows, checked once at start with errors naming the file, the row and
the field, so a bad row never surfaces mid-run.

Row schema (a JSON object per line, or a dataset's columns):
- the prompt: `messages`, a list of chat messages ({"role": "system" | "user" | "assistant" |
  "tool", "content": str}), or `prompt`, a string (one user message); `question` is read as
  `prompt` (GSM8K's column name);
- the label the reward reads: `answer` (a string or a number); `label` is read as `answer`;
- every other column goes to the item's metadata, for custom reward functions.
An SFT job (spec.recipe sft) reads the same rows but needs no label: a row is `messages` with the
assistant turns to learn, or a prompt with its `response` (a string; `answer` stands in for it when
there is none, as the SFT warm start reads the reference answers).
A row with `instruction` is a shell task instead (`instruction`, `test`, optional `setup` and
`solution`; lockstep.tasks.shell.rows), run in a sandbox by the terminal agent.

Sources (`data.prompts`, `data.evalPrompts`):
- a JSON-lines file;
- a directory of `*.jsonl` files, read in name order;
- a directory saved by `datasets` (`save_to_disk` of a Dataset or a DatasetDict);
- a directory of `*.parquet`, `*.arrow`, `*.csv` or `*.json` files (`datasets.load_dataset`);
- a copy of a Hugging Face dataset repo (its README's `configs`, or data files in subdirectories:
  `datasets.load_dataset(DIR, CONFIG)`), e.g. the snapshot a hub dataset id resolves to
  (lockstep.models.hub_data).
A `:split` suffix picks a split of a dataset (`/data/gsm8k:test`), `:config:split` a config of a
dataset repo with several (`/data/gsm8k:main:test`); the default split is `train`.

Who calls it: lockstep.tasks.registry (load_task for every non-builtin source).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lockstep.tasks.base import Row
from lockstep.tasks.shell.rows import is_task_row, task_row

ROLES = frozenset({"system", "user", "assistant", "tool"})
_PROMPT_KEYS = ("messages", "prompt", "question")
_LABEL_KEYS = ("answer", "label")
_FILE_FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json"}


def read_rows(source: str, *, sft: bool = False) -> list[Row]:
    """The validated rows of a prompt source (see the module doc); raises naming the file and fix.
    `sft`: rows of an SFT job (no label needed)."""
    path, config, split = _split(source)
    if path.is_file():
        rows = list(_jsonl_rows(path, sft))
    elif path.is_dir():
        rows = list(_dir_rows(path, config, split, sft))
    else:
        raise FileNotFoundError(
            f"prompt source {source!r} does not exist; give a JSON-lines file, a directory of them, a "
            "directory saved by the datasets library, or builtin:<task>"
        )
    if not rows:
        raise ValueError(f"prompt source {source!r} holds no rows")
    return rows


def row_from(obj: Any, where: str, sft: bool = False) -> Row:
    """One row object -> Row; ValueError names `where` (file:line or dataset[index]) and the field.
    `sft`: an SFT job's row, whose label is optional (its answer is then "")."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(obj).__name__}")
    if is_task_row(obj):
        return task_row(obj, where)
    label_key = next((k for k in _LABEL_KEYS if obj.get(k) is not None), None)
    prompt_key = next((k for k in _PROMPT_KEYS if obj.get(k) is not None), None)
    if sft and prompt_key is not None and label_key is None:
        return _sft_row(obj, prompt_key, where)
    if label_key is None or prompt_key is None:
        raise ValueError(
            f'{where}: each row needs "messages" (chat messages) or "prompt" (a string), and "answer" '
            f"(the label the reward reads); this row has {sorted(obj)}"
        )
    label = obj[label_key]
    if not isinstance(label, str | int | float) or isinstance(label, bool):
        raise ValueError(f'{where}: "{label_key}" must be a string or a number, got {type(label).__name__}')
    if prompt_key == "messages":
        messages = _messages(obj["messages"], where)
    elif isinstance(obj[prompt_key], str):
        messages = ({"role": "user", "content": obj[prompt_key]},)
    else:
        raise ValueError(f'{where}: "{prompt_key}" must be a string; use "messages" for a chat')
    meta = {k: v for k, v in obj.items() if k not in (prompt_key, label_key)}
    return Row(messages, str(label), meta)


def _sft_row(obj: Mapping[str, Any], prompt_key: str, where: str) -> Row:
    """A row of an SFT job without a label: messages holding the assistant turns, or a prompt with
    its `response`."""
    if prompt_key == "messages":
        messages = _messages(obj["messages"], where)
        if not any(m["role"] == "assistant" for m in messages) and not isinstance(obj.get("response"), str):
            raise ValueError(
                f'{where}: an SFT row needs the assistant turns to learn: assistant messages in "messages", '
                'or a "response" string'
            )
    elif isinstance(obj[prompt_key], str):
        messages = ({"role": "user", "content": obj[prompt_key]},)
        if not isinstance(obj.get("response"), str):
            raise ValueError(
                f'{where}: an SFT row with "{prompt_key}" needs "response" (a string): the reply to learn'
            )
    else:
        raise ValueError(f'{where}: "{prompt_key}" must be a string; use "messages" for a chat')
    return Row(messages, "", {k: v for k, v in obj.items() if k != prompt_key})


def _messages(value: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(
                f'{where}: messages[{i}] must be {{"role": one of {sorted(ROLES)}, "content": a string}}'
            )
        out.append({"role": str(m["role"]), "content": str(m["content"])})
    return tuple(out)


def _split(source: str) -> tuple[Path, str | None, str]:
    """`PATH`, `PATH:split` or `PATH:config:split` -> (path, config, split) (the first reading whose
    path exists; a path that exists as given has no suffix)."""
    path = Path(source).expanduser()
    if path.exists():
        return path, None, "train"
    head, _, split = source.rpartition(":")
    if split and head and Path(head).expanduser().exists():
        return Path(head).expanduser(), None, split
    base, _, config = head.rpartition(":")
    if split and config and base and Path(base).expanduser().exists():
        return Path(base).expanduser(), config, split
    return path, None, "train"


def _jsonl_rows(path: Path, sft: bool = False) -> Iterable[Row]:
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not a JSON object ({e})") from None
        yield row_from(obj, f"{path}:{n}", sft)


def _dir_rows(path: Path, config: str | None, split: str, sft: bool = False) -> Iterable[Row]:
    jsonl = sorted(path.glob("*.jsonl"))
    if jsonl and config is None:
        for f in jsonl:
            yield from _jsonl_rows(f, sft)
        return
    dataset = _load_dataset(path, config, split)
    where = f"{path}[{config}:{split}]" if config else f"{path}[{split}]"
    for i, obj in enumerate(dataset):
        yield row_from(obj, f"{where}[{i}]", sft)


def _load_dataset(path: Path, config: str | None, split: str) -> Any:
    """A local dataset's split through the `datasets` library (saved to disk, data files, or a copy of
    a dataset repo)."""
    import datasets

    if config is not None or _is_repo_copy(path):
        return _load_repo_copy(path, config, split)

    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(
                    f"{path}: no split {split!r}; it has {sorted(loaded)} (pick one with :SPLIT)"
                )
            return loaded[split]
        return loaded
    files = {fmt: sorted(str(f) for f in path.glob(f"*{ext}")) for ext, fmt in _FILE_FORMATS.items()}
    found = {fmt: fs for fmt, fs in files.items() if fs}
    if len(found) != 1:
        raise ValueError(
            f"{path}: expected *.jsonl files, a dataset saved by datasets.save_to_disk, or data files of one "
            f"format (parquet, arrow, csv, json); found {sorted(found) or 'none'}"
        )
    ((fmt, data_files),) = found.items()
    return datasets.load_dataset(fmt, data_files={split: data_files}, split=split)


def _is_repo_copy(path: Path) -> bool:
    """A copy of a dataset repo: a README.md (its card declares the configs) and no data files at the
    top, or data files only in subdirectories (the layout `datasets` infers splits from)."""
    top = any(True for ext in _FILE_FORMATS for _ in path.glob(f"*{ext}"))
    if top or (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return False
    nested = any(True for ext in (*_FILE_FORMATS, ".jsonl") for _ in path.glob(f"*/**/*{ext}"))
    return (path / "README.md").is_file() or nested


def _load_repo_copy(path: Path, config: str | None, split: str) -> Any:
    """`datasets.load_dataset(path, config, split=split)` with errors that name the fix."""
    import datasets

    try:
        return datasets.load_dataset(str(path), config, split=split)
    except ValueError as e:
        first = " ".join(str(e).split())[:300] or type(e).__name__  # datasets' message, on one line
        if "config" in first.lower():
            raise ValueError(
                f"{path}: pick a config of this dataset with PATH:CONFIG:SPLIT ({first})"
            ) from None
        if "split" in first.lower():
            raise ValueError(f"{path}: no split {split!r} ({first}); pick one with :SPLIT") from None
        raise ValueError(f"{path}: cannot load it as a dataset: {first}") from None
