"""Generate the CustomResourceDefinitions in crds/ from the lockstep.api models.

Why it exists: the CRDs must say exactly what the models say (fields, docs, defaults, enums, limits)
plus the cross-field rules as CEL, and must never drift. This module turns each kind's pydantic JSON
schema into a Kubernetes structural schema: $refs inlined, titles dropped, `X | None` turned into an
optional (not required) field, Literal/const turned into enums, JSON-Schema-2020 exclusive bounds
turned into OpenAPI v3.0 booleans, attribute docstrings kept as descriptions, and each model's
rules (lockstep.api.rules) attached as x-kubernetes-validations where the model sits.

Optional fields are deliberately not `nullable`: the apiserver then prunes an explicit `null`, so an
unset field is absent for CEL `has()` exactly as it is None for pydantic; with nullable a `null`
would be present for CEL but unset for Python, and the two validators would disagree.

Who calls it: `python -m lockstep.api.crdgen --out crds` (make crds) and `--check` (make crds-check,
which fails when crds/ is out of date); tests and the e2e suite (they install the output).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import sys
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from lockstep.api.common import GROUP, VERSION
from lockstep.api.rljob import RLJob
from lockstep.api.rolloutpool import RolloutPool
from lockstep.api.rules import rules_for
from lockstep.api.trainergroup import TrainerGroup
from lockstep.api.weightchannel import WeightChannel


@dataclass(frozen=True, slots=True)
class Column:
    """One additionalPrinterColumns entry."""

    name: str
    type: str
    json_path: str
    description: str
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Kind:
    """How one model becomes a CRD: names, columns, subresources."""

    model: type[BaseModel]
    plural: str
    short_names: tuple[str, ...]
    columns: tuple[Column, ...]
    scale: bool = False
    categories: tuple[str, ...] = field(default=("lockstep",))


AGE = Column("Age", "date", ".metadata.creationTimestamp", "Time since creation.")

KINDS: tuple[Kind, ...] = (
    Kind(
        RLJob,
        "rljobs",
        ("rlj",),
        (
            Column("Phase", "string", ".status.phase", "Where the job is in its life."),
            Column("Step", "integer", ".status.step", "Optimizer steps done."),
            Column("Version", "integer", ".status.weightVersion", "Weight version all engines hold."),
            Column("Reward", "number", ".status.reward", "Moving average of the raw reward."),
            Column("Staleness", "integer", ".status.staleness", "Largest staleness of the last step."),
            Column("Transport", "string", ".status.transport", "Weight transport in use."),
            AGE,
            Column("Queue", "integer", ".status.queueSize", "Complete groups waiting in the buffer.", 1),
            Column("Restarts", "integer", ".status.restarts", "Restarts so far.", 1),
        ),
    ),
    Kind(
        RolloutPool,
        "rolloutpools",
        ("rpool", "rp"),
        (
            Column("Desired", "integer", ".spec.replicas", "Desired replicas."),
            Column("Ready", "integer", ".status.readyReplicas", "Ready replicas."),
            Column(
                "Version", "integer", ".status.weightVersion", "Weight version every ready replica holds."
            ),
            AGE,
            Column("Job", "string", ".spec.job", "The RLJob served.", 1),
        ),
        scale=True,
    ),
    Kind(
        TrainerGroup,
        "trainergroups",
        ("tg",),
        (
            Column("Backend", "string", ".spec.trainer.backend", "Training backend."),
            Column("World", "integer", ".status.worldSize", "Ranks in the world."),
            Column("Ready", "integer", ".status.readyRanks", "Ranks ready."),
            Column("Step", "integer", ".status.step", "Optimizer steps done."),
            AGE,
            Column("Restarts", "integer", ".status.restarts", "Gang restarts.", 1),
        ),
    ),
    Kind(
        WeightChannel,
        "weightchannels",
        ("wch",),
        (
            Column("Transport", "string", ".status.transport", "Transport in use."),
            Column("Version", "integer", ".status.weightVersion", "Last version delivered."),
            Column("Preflight", "boolean", ".status.preflightPassed", "Weight-equality preflight result."),
            Column("Sync", "number", ".status.lastUpdateSeconds", "Seconds of the last update."),
            Column("Slowest", "string", ".status.lastUpdateSlowest", "Its slowest phase and share."),
            AGE,
            Column("Reason", "string", ".status.reason", "Why this transport.", 1),
        ),
    ),
)
"""The four kinds and their CRD presentation."""


def _model_classes(model: type[BaseModel]) -> Iterator[type[BaseModel]]:
    """The model and every model reachable through its field annotations."""
    seen: set[type[BaseModel]] = set()
    todo: list[Any] = [model]
    while todo:
        tp = todo.pop()
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp in seen:
                continue
            seen.add(tp)
            yield tp
            todo.extend(f.annotation for f in tp.model_fields.values())
        elif isinstance(tp, types.UnionType) or typing.get_origin(tp) is not None:
            todo.extend(typing.get_args(tp))


def _describe(text: str) -> str:
    """Docstring -> description: lines of a paragraph joined, paragraphs kept."""
    paragraphs = [" ".join(line.strip() for line in p.splitlines()) for p in text.strip().split("\n\n")]
    return "\n\n".join(paragraphs)


class _Inliner:
    """Turns a pydantic JSON schema into a Kubernetes structural schema."""

    def __init__(self, defs: dict[str, Any], classes: dict[str, type[BaseModel]]) -> None:
        self.defs = defs
        self.classes = classes

    def convert(self, node: dict[str, Any]) -> dict[str, Any]:
        node = dict(node)
        if "$ref" in node:
            name = node.pop("$ref").split("/")[-1]
            target = copy.deepcopy(self.defs[name])
            target.update(node)  # the field's own description and default win over the type's
            node = target
            if node.get("default") == {} and name in self.classes:
                # The apiserver checks a default against the CEL rules as written, without filling
                # in nested defaults first, so the default must be the complete section.
                node["default"] = self.classes[name]().model_dump(
                    mode="json", by_alias=True, exclude_none=True
                )
        if "anyOf" in node:
            branches = [b for b in node.pop("anyOf") if b != {"type": "null"}]
            if len(branches) != 1:
                raise ValueError(f"cannot express a union of {branches} in a structural schema")
            merged = self.convert(branches[0])
            merged.update({k: v for k, v in node.items() if not (k == "default" and v is None)})
            node = merged
        if node.get("default", 0) is None:
            del node["default"]
        if "const" in node:
            node["enum"] = [node.pop("const")]
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if key in node and not isinstance(node[key], bool):
                node[key.replace("exclusiveM", "m")] = node[key]
                node[key] = True
        node.pop("title", None)
        if node.get("additionalProperties") is False:
            del node["additionalProperties"]
        if "description" in node:
            node["description"] = _describe(node["description"])
        if "properties" in node:
            node["properties"] = {k: self.convert(v) for k, v in node["properties"].items()}
        if isinstance(node.get("additionalProperties"), dict):
            node["additionalProperties"] = self.convert(node["additionalProperties"])
        if "items" in node:
            node["items"] = self.convert(node["items"])
        unsupported = sorted(k for k in node if k not in _ALLOWED and not k.startswith("x-kubernetes-"))
        if unsupported:
            raise ValueError(f"schema keywords {unsupported} are not allowed in a CRD schema (in {node})")
        return _ordered(node)


_ALLOWED = frozenset(
    {
        "description",
        "type",
        "format",
        "enum",
        "default",
        "minimum",
        "exclusiveMinimum",
        "maximum",
        "exclusiveMaximum",
        "multipleOf",
        "minLength",
        "maxLength",
        "pattern",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "required",
        "properties",
        "additionalProperties",
        "items",
    }
)
"""Schema keywords a structural CRD schema accepts (others, e.g. propertyNames, the apiserver refuses)."""

_KEY_ORDER = (
    "description",
    "type",
    "format",
    "enum",
    "default",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "maxProperties",
    "required",
    "properties",
    "additionalProperties",
    "items",
)


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    rank = {k: i for i, k in enumerate(_KEY_ORDER)}
    return dict(sorted(node.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


def schema_for(model: type[BaseModel]) -> dict[str, Any]:
    """The structural openAPIV3Schema of a kind model (apiVersion, kind, metadata, spec, status)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs: dict[str, Any] = raw.get("$defs", {})
    classes = {cls.__name__: cls for cls in _model_classes(model)}
    for name, cls in classes.items():
        rules = rules_for(cls)
        if rules and name in defs:
            defs[name]["x-kubernetes-validations"] = [r.x_kubernetes_validation() for r in rules]
    inliner = _Inliner(defs, classes)
    props = raw["properties"]
    root: dict[str, Any] = {
        "description": _describe(model.__doc__ or ""),
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {
                "description": "APIVersion of the object: rl.lockstep.dev/v1alpha1.",
                "type": "string",
            },
            "kind": {"description": f"Kind of the object: {model.__name__}.", "type": "string"},
            "metadata": {"type": "object"},
            "spec": inliner.convert(props["spec"]),
            "status": inliner.convert(props["status"]),
        },
    }
    rules = rules_for(model)
    if rules:
        root["x-kubernetes-validations"] = [r.x_kubernetes_validation() for r in rules]
    return root


def crd_for(kind: Kind) -> dict[str, Any]:
    """The CustomResourceDefinition of one kind."""
    name = kind.model.__name__
    subresources: dict[str, Any] = {"status": {}}
    if kind.scale:
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    columns = []
    for c in kind.columns:
        col: dict[str, Any] = {
            "name": c.name,
            "type": c.type,
            "jsonPath": c.json_path,
            "description": c.description,
        }
        if c.priority:
            col["priority"] = c.priority
        columns.append(col)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{kind.plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": name,
                "listKind": f"{name}List",
                "plural": kind.plural,
                "singular": name.lower(),
                "shortNames": list(kind.short_names),
                "categories": list(kind.categories),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema_for(kind.model)},
                    "subresources": subresources,
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


HEADER = "# Generated by `python -m lockstep.api.crdgen --out crds` from lockstep.api. Do not edit.\n"


def render() -> dict[str, str]:
    """File name -> YAML text of every CRD, plus the kustomization listing them.

    The kustomization lets `kubectl apply -k manifests/` (which names ../crds) install the CRDs:
    kustomize loads no file outside a kustomization root.
    """
    files = {
        f"{GROUP}_{k.plural}.yaml": HEADER + yaml.safe_dump(crd_for(k), sort_keys=False, width=100)
        for k in KINDS
    }
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": sorted(files),
    }
    files["kustomization.yaml"] = HEADER + yaml.safe_dump(kustomization, sort_keys=False)
    return files


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lockstep.api.crdgen", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("crds"), help="directory of the CRD files")
    parser.add_argument("--check", action="store_true", help="fail with a diff when --out is out of date")
    args = parser.parse_args(argv)
    files = render()
    if args.check:
        stale = []
        for name, text in files.items():
            path = args.out / name
            current = path.read_text(encoding="utf-8") if path.exists() else ""
            if current != text:
                stale.append(name)
                diff = difflib.unified_diff(
                    current.splitlines(), text.splitlines(), str(path), "generated", lineterm="", n=1
                )
                print("\n".join(list(diff)[:30]))
        if stale:
            print(
                f"crds out of date: {', '.join(stale)}; run: python -m lockstep.api.crdgen --out {args.out}",
                file=sys.stderr,
            )
            return 1
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out / name).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
