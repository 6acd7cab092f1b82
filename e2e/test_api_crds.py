"""The generated CRDs on the real apiserver: examples apply, bad manifests are refused, kubectl reads well.

Why: `lockstep validate` and `kubectl apply` must refuse the same manifests with the same meaning,
the apiserver's defaulting must give the object pydantic gives, and the human-facing bits (printer
columns, /scale, `kubectl explain`) must work through the real kubectl. The bad manifests are the
table of runtime/tests/api/bad_manifests.yaml, the same rows the offline tests run.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.api import (
    Condition,
    RLJob,
    RLJobStatus,
    RolloutPool,
    TrainerGroup,
    WeightChannel,
    load_manifest,
)
from lockstep.api.crdgen import KINDS, render
from lockstep.api.weightchannel import WeightChannelStatus

from e2e.controlplane.cluster import ControlPlane

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _load_table_module() -> Any:
    # the table lives with the offline tests (runtime/tests is not a package): load it by path
    path = REPO / "runtime" / "tests" / "api" / "api_bad_manifests.py"
    spec = importlib.util.spec_from_file_location("api_bad_manifests", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("api_bad_manifests", module)
    spec.loader.exec_module(module)
    return module


TABLE = _load_table_module().load_table()


def install_crds(cluster: ControlPlane) -> None:
    """Apply the CRDs exactly as generated now and wait until each is Established."""
    cluster.apply("\n---\n".join(text for name, text in render().items() if name != "kustomization.yaml"))
    for kind in KINDS:
        cluster.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s", f"crd/{kind.plural}.rl.lockstep.dev"
        )


@pytest.fixture(scope="module")
def crds(cluster: ControlPlane) -> Iterator[ControlPlane]:
    """The CRDs exactly as generated now, installed and Established."""
    install_crds(cluster)
    yield cluster


@pytest.fixture(scope="module")
def refusals_namespace(crds: ControlPlane) -> Iterator[str]:
    """One namespace for all the refused applies (nothing is ever created in it, so it can be shared)."""
    name = f"e2e-api-{uuid.uuid4().hex[:8]}"
    crds.kubectl("create", "namespace", name)
    yield name
    crds.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _prune_empty(value: Any) -> Any:
    """Drop empty lists and maps: pydantic fills them, the apiserver leaves them absent."""
    if isinstance(value, dict):
        return {k: _prune_empty(v) for k, v in value.items() if v not in ({}, [])}
    if isinstance(value, list):
        return [_prune_empty(v) for v in value]
    return value


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_applies_and_apiserver_defaults_equal_pydantic(
    crds: ControlPlane, namespace: str, path: Path
) -> None:
    crds.apply(path.read_text(), namespace=namespace)
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    stored = crds.get("rljob", name, "-n", namespace)
    # every default the CRD fills is the default pydantic fills (numbers compare by value: 2 == 2.0)
    assert _prune_empty(stored["spec"]) == _prune_empty(load_manifest(path).spec.wire())
    RLJob.model_validate(stored)  # and what the operator reads back parses


@pytest.mark.parametrize("row", TABLE, ids=[r.name for r in TABLE])
def test_bad_manifest_is_refused_at_apply(crds: ControlPlane, refusals_namespace: str, row: Any) -> None:
    namespace = refusals_namespace
    proc = crds.apply(row.manifest, namespace=namespace, check=False)
    assert proc.returncode != 0, f"{row.name} was accepted"
    assert row.apiserver in proc.stderr, proc.stderr
    assert row.path in proc.stderr, proc.stderr
    assert crds.kubectl("get", "rljob", row.name, "-n", namespace, check=False).returncode != 0


def test_model_and_backend_cannot_change(crds: ControlPlane, namespace: str) -> None:
    doc = yaml.safe_load((REPO / "examples" / "glm5-gb300.yaml").read_text())
    crds.apply(doc, namespace=namespace)
    changed = json.loads(json.dumps(doc))
    changed["spec"]["model"]["checkpoint"] = "/models/other"
    proc = crds.apply(changed, namespace=namespace, check=False)
    assert proc.returncode != 0 and "the model cannot change after creation" in proc.stderr, proc.stderr
    changed = json.loads(json.dumps(doc))
    changed["spec"]["trainer"]["backend"] = "megatron"
    proc = crds.apply(changed, namespace=namespace, check=False)
    assert proc.returncode != 0 and "the trainer backend cannot change after creation" in proc.stderr, (
        proc.stderr
    )
    changed = json.loads(json.dumps(doc))
    changed["spec"]["schedule"]["steps"] = 7  # anything else may change
    crds.apply(changed, namespace=namespace)
    assert crds.get("rljob", "glm5-gb300", "-n", namespace)["spec"]["schedule"]["steps"] == 7


def _table(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines()]


def test_rljob_printer_columns(crds: ControlPlane, namespace: str) -> None:
    crds.apply((REPO / "examples" / "tiny-local.yaml").read_text(), namespace=namespace)
    running = Condition(
        type="Progressing",
        status="True",
        reason="StepDone",
        message="step 12",
        last_transition_time=dt.datetime(2026, 12, 2, 10, 0, 0, 250000, tzinfo=dt.UTC),
        observed_generation=1,
    )
    status = RLJobStatus(
        conditions=[running],
        phase="Running",
        step=12,
        weight_version=12,
        reward=0.5,
        staleness=1,
        queue_size=3,
        transport="broadcast",
        restarts=2,
    )
    crds.kubectl(
        "patch",
        "rljob",
        "tiny-local",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status.wire()}),
    )
    head, row = _table(crds.kubectl("get", "rljobs", "-n", namespace).stdout)
    assert head == ["NAME", "PHASE", "STEP", "VERSION", "REWARD", "STALENESS", "TRANSPORT", "AGE"]
    assert row[:7] == ["tiny-local", "Running", "12", "12", "0.5", "1", "broadcast"]
    head, row = _table(crds.kubectl("get", "rlj", "-n", namespace, "-o", "wide").stdout)
    assert head[-2:] == ["QUEUE", "RESTARTS"] and row[-2:] == ["3", "2"]
    # the status round-trips through the apiserver into the model the operator uses
    assert RLJob.model_validate(crds.get("rljob", "tiny-local", "-n", namespace)).status == status


def _pool(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "rl.lockstep.dev/v1alpha1",
        "kind": "RolloutPool",
        "metadata": {"name": name},
        "spec": {
            "job": "tiny-local",
            "replicas": 2,
            "autoscaling": {"minReplicas": 1, "maxReplicas": 4},
            "model": {"checkpoint": "builtin:tiny", "family": "tiny"},
        },
    }


def test_scale_rolloutpool_changes_spec_replicas(crds: ControlPlane, namespace: str) -> None:
    RolloutPool.model_validate(_pool("pool"))
    crds.apply(_pool("pool"), namespace=namespace)
    crds.kubectl(
        "patch",
        "rpool",
        "pool",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(
            {
                "status": {
                    "replicas": 2,
                    "readyReplicas": 1,
                    "weightVersion": 4,
                    "selector": "rl.lockstep.dev/pool=pool",
                }
            }
        ),
    )
    crds.kubectl("scale", "rolloutpool", "pool", "-n", namespace, "--replicas=3")
    assert crds.get("rolloutpool", "pool", "-n", namespace)["spec"]["replicas"] == 3
    head, row = _table(crds.kubectl("get", "rolloutpools", "-n", namespace).stdout)
    assert head == ["NAME", "DESIRED", "READY", "VERSION", "AGE"] and row[:4] == ["pool", "3", "1", "4"]
    scale = crds.api_get(f"/apis/rl.lockstep.dev/v1alpha1/namespaces/{namespace}/rolloutpools/pool/scale")
    assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (3, 2)
    assert scale["status"]["selector"] == "rl.lockstep.dev/pool=pool"
    proc = crds.kubectl("scale", "rolloutpool", "pool", "-n", namespace, "--replicas=9", check=False)
    assert proc.returncode != 0 and "replicas must lie within autoscaling" in proc.stderr, proc.stderr


def test_child_kinds_apply_from_the_models(crds: ControlPlane, namespace: str) -> None:
    model = {"checkpoint": "builtin:tiny", "family": "tiny"}
    tg = TrainerGroup.model_validate(
        {
            "metadata": {"name": "tg"},
            "spec": {
                "job": "j",
                "model": model,
                "trainer": {"backend": "fsdp", "device": "cpu", "gpusPerNode": 1},
            },
        }
    )
    wch = WeightChannel.model_validate(
        {"metadata": {"name": "wch"}, "spec": {"job": "j", "trainerGroup": "tg", "rolloutPool": "pool"}}
    )
    crds.apply([tg.wire(), wch.wire()], namespace=namespace)
    head, row = _table(crds.kubectl("get", "tg", "-n", namespace).stdout)
    assert head[:2] == ["NAME", "BACKEND"] and row[:2] == ["tg", "fsdp"]
    names = crds.kubectl("get", "lockstep", "-n", namespace, "-o", "name").stdout.split()
    assert sorted(names) == ["trainergroup.rl.lockstep.dev/tg", "weightchannel.rl.lockstep.dev/wch"]
    stored = crds.get("weightchannel", "wch", "-n", namespace)
    assert _prune_empty(stored["spec"]) == _prune_empty(wch.spec.wire())


def test_weightchannel_columns_show_the_last_sync(crds: ControlPlane, namespace: str) -> None:
    """`kubectl get wch` shows the last update's seconds and its slowest phase; the phases round-trip."""
    wch = WeightChannel.model_validate(
        {"metadata": {"name": "sync"}, "spec": {"job": "j", "trainerGroup": "tg", "rolloutPool": "pool"}}
    )
    crds.apply(wch.wire(), namespace=namespace)
    phases = {"gather": 0.25, "transfer": 1.5, "engine_load": 0.5, "pause": 0.001}
    status = WeightChannelStatus(
        transport="broadcast", weight_version=7, preflight_passed=True, last_update_seconds=2.251,
        last_update_phases=phases, last_update_slowest="transfer 67%",
    )  # fmt: skip
    crds.kubectl("patch", "wch", "sync", "-n", namespace, "--subresource=status", "--type=merge",
                 "-p", json.dumps({"status": status.wire()}))  # fmt: skip
    head, row = _table(crds.kubectl("get", "wch", "sync", "-n", namespace).stdout)
    assert head == ["NAME", "TRANSPORT", "VERSION", "PREFLIGHT", "SYNC", "SLOWEST", "AGE"]
    assert row[:7] == ["sync", "broadcast", "7", "true", "2.251", "transfer", "67%"]
    stored = WeightChannel.model_validate(crds.get("weightchannel", "sync", "-n", namespace))
    assert stored.status is not None and stored.status.last_update_phases == phases


def test_kubectl_explain_shows_the_docstrings(crds: ControlPlane) -> None:
    out = crds.kubectl("explain", "rljob.spec.rollout").stdout
    assert "Rollout engines, sampling and the session server." in out
    assert "DP-attention size: attention runs data-parallel" in " ".join(out.split())
    out = crds.kubectl("explain", "rljob.spec.weightSync.bucketMiB").stdout
    assert "Bucket size in MiB" in out
    out = crds.kubectl("explain", "rolloutpool.status.selector").stdout
    assert "Label selector of the replica pods" in out
