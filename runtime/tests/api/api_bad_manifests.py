"""The table of bad manifests (bad_manifests.yaml) turned into manifests, for offline and e2e tests.

Why it exists: the same table must be refused by `lockstep validate` (runtime/tests/api) and by the
real apiserver (e2e/test_api_crds.py); both build the manifests here so they test the same objects.
"""

from __future__ import annotations

import copy
import functools
import random
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
    """The decoded example examples/<name>.yaml (a fresh copy)."""
    return copy.deepcopy(_parsed_example(name))


@functools.cache
def _parsed_example(name: str) -> dict[str, Any]:
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


# Values that the cross-field rules look at; every combination is valid field by field, so whether a
# random manifest passes depends on the rules alone.
CHOICES: dict[str, list[Any]] = {
    "spec.schedule.mode": ["sync", "fully-async"],
    "spec.schedule.colocate": [False, True],
    "spec.schedule.maxWeightStaleness": [None, 0, 3],
    "spec.schedule.evalInterval": [None, 5],
    "spec.data.evalPrompts": [None, "builtin:reverse"],
    "spec.weightSync.transport": ["auto", "broadcast", "p2p", "disk-delta", "cuda-ipc"],
    "spec.model.lora": [None, {"rank": 4}],
    "spec.model.variant": [None, "4b", "8b"],
    "spec.model.family": ["tiny", "qwen3"],
    "spec.rollout.prefillDecode": [False, True],
    "spec.rollout.multiTokenPrediction": [False, True],
    "spec.rollout.sampling.maxSessionTokens": [None, 4096],
    "spec.weightSync.pauseMode": ["retract", "abort", "in_place"],
    "spec.rollout.precision": ["bf16", "fp8", "nvfp4"],
    "spec.rollout.gpusPerEngine": [0, 1, 4],
    "spec.rollout.tensorParallel": [1, 2, 4],
    "spec.rollout.dataParallelAttention": [1, 2, 4],
    "spec.rollout.replicas": [1, 3, 5],
    "spec.rollout.autoscaling": [
        None,
        {"minReplicas": 2, "maxReplicas": 4},
        {"minReplicas": 4, "maxReplicas": 2},
    ],
    "spec.rollout.maxInFlight": [2, 64],
    "spec.algorithm.samplesPerPrompt": [4, 8],
    "spec.algorithm.trueOnPolicy": [False, True],
    "spec.algorithm.mismatch.low": [0.0, 2.5],
    "spec.trainer.precision": ["bf16", "nvfp4"],
    "spec.trainer.backend": ["fsdp", "megatron"],
    "spec.trainer.device": ["cpu", "cuda"],
    "spec.trainer.offload": ["none", "cpu", "disk"],
    "spec.trainer.nodes": [1, 2, 3],
    "spec.trainer.gpusPerNode": [1, 4, 8],
    "spec.trainer.parallelism.tensor": [1, 2, 4],
    "spec.trainer.parallelism.pipeline": [1, 2],
    "spec.trainer.parallelism.context": [1, 2],
    "spec.algorithm.opd": [
        None,
        {"teachers": [{"name": "t", "url": "http://t:30000"}]},
        {"teachers": [{"name": "t", "checkpoint": "builtin:tiny", "labels": ["reverse"]}]},
        {"teachers": [{"name": "t", "url": "http://t:30000", "labels": ["x"]}], "defaultTeacher": "t"},
    ],
    "spec.recipe": ["rl", "sft"],
    "spec.rollout.sampling.temperature": [1.0, 0.5],
    "spec.trainer.parallelism.expert": [1, 2, 8],
    "spec.placement.gang": [
        {"scheduler": "none"},
        {"scheduler": "kueue"},
        {"scheduler": "kueue", "queueName": "q"},
    ],
}


def random_manifest(rng: random.Random, name: str, change: float = 0.08) -> dict[str, Any]:
    """tiny-local (valid) with each rule-relevant field, with probability `change`, set to a random
    choice (None leaves it unset); about a third of the results pass."""
    manifest = example("tiny-local")
    manifest["metadata"]["name"] = name
    for dotted, values in CHOICES.items():
        value = rng.choice(values)
        if rng.random() < change and value is not None:
            _set(manifest, dotted, value)
    return manifest
