"""Load and check Lockstep manifests offline, with one clear line per problem.

Why it exists: `lockstep run` needs the typed RLJob of a YAML file, and `lockstep validate` must refuse
what `kubectl apply` would refuse, with messages that say what to do. Parsing (pydantic: types, enums,
limits, unknown fields) and the cross-field rules (lockstep.api.rules, the same expressions the CRDs
carry as CEL) both end up here as `Problem`s: `path: value: what to do`.

Who uses it: lockstep.cli.validate, lockstep.cli.run (the runtime), tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import yaml
from pydantic import BaseModel, ValidationError

from lockstep.api.rljob import RLJob
from lockstep.api.rolloutpool import RolloutPool
from lockstep.api.rules import Problem, check_rules
from lockstep.api.trainergroup import TrainerGroup
from lockstep.api.weightchannel import WeightChannel

KINDS: Final[dict[str, type[BaseModel]]] = {
    "RLJob": RLJob,
    "RolloutPool": RolloutPool,
    "TrainerGroup": TrainerGroup,
    "WeightChannel": WeightChannel,
}
"""The model of each kind."""


class ManifestError(ValueError):
    """A manifest that cannot be used; str() is one `path: value: what to do` line per problem."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


_HINTS: Final[dict[str, str]] = {
    "missing": "required: add it",
    "extra_forbidden": "unknown field: remove it or fix the spelling (fields are camelCase)",
}


def _problems_from(err: ValidationError, prefix: str) -> list[Problem]:
    out = []
    for e in err.errors(include_url=False):
        parts = [prefix] if prefix else []
        for loc in e["loc"]:
            if isinstance(loc, int):
                parts[-1] = f"{parts[-1]}[{loc}]" if parts else f"[{loc}]"
            else:
                parts.append(str(loc))
        value = None if e["type"] == "missing" else e.get("input")
        if isinstance(value, dict | list) and e["type"] != "extra_forbidden":
            value = None  # a whole section would drown the line; the path says where
        message = _HINTS.get(e["type"], e["msg"].removeprefix("Value error, "))
        out.append(Problem(".".join(parts), value, message))
    return out


def _read(path_or_text: str | Path) -> list[Any]:
    """The YAML documents of a file, or of YAML text.

    A Path is a file. A str is YAML text when it has a newline or starts with `{`; otherwise it is a
    file path (so a mistyped path raises FileNotFoundError rather than parsing as YAML).
    """
    if isinstance(path_or_text, str) and ("\n" in path_or_text or path_or_text.lstrip().startswith("{")):
        text = path_or_text
    else:
        text = Path(path_or_text).read_text(encoding="utf-8")
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError([Problem("(yaml)", None, f"not valid YAML: {exc}".replace("\n", " "))]) from exc
    return docs


def parse_object(doc: Any, prefix: str = "") -> BaseModel:
    """Validate one decoded document as its kind, including the cross-field rules."""
    if not isinstance(doc, dict):
        raise ManifestError(
            [
                Problem(
                    prefix or "(document)",
                    None,
                    "expected a mapping with apiVersion, kind, metadata and spec",
                )
            ]
        )
    kind = doc.get("kind")
    model = KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        where = f"{prefix}.kind" if prefix else "kind"
        raise ManifestError([Problem(where, kind, f"must be one of {', '.join(KINDS)}")])
    try:
        obj = model.model_validate(doc)
    except ValidationError as err:
        raise ManifestError(_problems_from(err, prefix)) from err
    problems = check_rules(obj, prefix)
    if problems:
        raise ManifestError(problems)
    return obj


def load_objects(path_or_text: str | Path) -> list[BaseModel]:
    """Every object of a (multi-document) manifest; all problems of all documents in one error."""
    docs = _read(path_or_text)
    if not docs:
        raise ManifestError([Problem("(document)", None, "the manifest is empty: write an RLJob")])
    objects: list[BaseModel] = []
    problems: list[Problem] = []
    for i, doc in enumerate(docs):
        try:
            objects.append(parse_object(doc, f"[{i}]" if len(docs) > 1 else ""))
        except ManifestError as err:
            problems.extend(err.problems)
    if problems:
        raise ManifestError(problems)
    return objects


def load_manifest(path_or_text: str | Path) -> RLJob:
    """The one RLJob of a manifest file (a path) or YAML text.

    Raises ManifestError (one `path: value: what to do` line per problem) for a bad manifest and
    FileNotFoundError for a missing file.
    """
    objects = load_objects(path_or_text)
    jobs = [o for o in objects if isinstance(o, RLJob)]
    if len(jobs) != 1:
        raise ManifestError(
            [
                Problem(
                    "kind",
                    [type(o).__name__ for o in objects],
                    f"expected exactly one RLJob, found {len(jobs)}: keep one RLJob per file",
                )
            ]
        )
    return jobs[0]


def check_update(old: BaseModel, new: BaseModel) -> list[Problem]:
    """Problems of changing `old` into `new`: the transition rules (immutable model and backend).

    `new` must itself be valid (parse_object); this adds only what an update checks on top.
    """
    return check_rules(new, "", old_obj=old)
