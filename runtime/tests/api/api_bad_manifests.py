"""The table of bad manifests (bad_manifests.yaml) turned into manifests, for offline and e2e tests.

Why it exists: the same table must be refused by `lockstep validate` (runtime/tests/api) and by the
real apiserver (e2e/test_api_crds.py); both build the manifests here so they test the same objects.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
EXAMPLES = REPO / "examples"
TABLE = HERE / "bad_manifests.yaml"


@dataclass(frozen=True, slots=True)
class BadManifest:
    """One row of the table, built."""

    name: str
    """Row name; also the object's metadata.name."""
    manifest: dict[str, Any]
    """The bad object."""
    path: str
    """Where the problem is (dotted wire path)."""
    message: str
    """Fragment of the `lockstep validate` message."""
    apiserver: str
    """Fragment of the apiserver's refusal."""


def example(name: str) -> dict[str, Any]:
    """The decoded example examples/<name>.yaml."""
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    return doc


def _set(obj: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        obj = obj.setdefault(key, {})
    obj[last] = copy.deepcopy(value)


def _delete(obj: dict[str, Any], dotted: str) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        obj = obj[key]
    del obj[last]


def load_table() -> list[BadManifest]:
    rows = yaml.safe_load(TABLE.read_text())
    out = []
    for row in rows:
        manifest = example(row["base"])
        manifest["metadata"]["name"] = row["name"]
        for dotted, value in (row.get("set") or {}).items():
            _set(manifest, dotted, value)
        for dotted in row.get("delete") or []:
            _delete(manifest, dotted)
        out.append(
            BadManifest(
                row["name"], manifest, row["path"], row["message"], row.get("apiserver", row["message"])
            )
        )
    return out
