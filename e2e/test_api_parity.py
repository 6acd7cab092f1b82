"""`lockstep validate` and the apiserver agree on random manifests, rule by rule.

Why: each cross-field rule is one declaration compiled to CEL and evaluated in Python; this checks the
two evaluations agree on manifests nobody wrote by hand. Each random manifest (seeded, so a failure
reproduces) goes through the Python rules and through `kubectl apply --dry-run=server` (validation
and CEL run, nothing is stored); the sets of fired rule messages must be equal.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from lockstep.api import RULES, ManifestError, parse_object

from e2e.controlplane.cluster import ControlPlane
from e2e.test_api_crds import _load_table_module, install_crds

N = 40
SEED = 20261202


@pytest.fixture(scope="module")
def crds_namespace(cluster: ControlPlane) -> Iterator[str]:
    install_crds(cluster)
    name = f"e2e-parity-{random.Random().getrandbits(32):08x}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def python_verdict(manifest: dict[str, Any]) -> set[str]:
    try:
        parse_object(manifest)
    except ManifestError as err:
        return {p.message for p in err.problems}
    return set()


def test_random_manifests_get_the_same_verdict(cluster: ControlPlane, crds_namespace: str) -> None:
    table = _load_table_module()
    rng = random.Random(SEED)
    refused = 0
    for i in range(N):
        manifest = table.random_manifest(rng, f"r{i}")
        expected = python_verdict(manifest)
        assert expected <= {r.message for r in RULES}, f"#{i}: a field-level problem, not a rule: {expected}"
        proc = cluster.kubectl(
            "apply",
            "--dry-run=server",
            "--server-side",
            "--field-manager=e2e",
            "-n",
            crds_namespace,
            "-f",
            "-",
            input=yaml.safe_dump(manifest),
            check=False,
        )
        fired = {r.message for r in RULES if r.message in proc.stderr}
        assert (proc.returncode != 0, fired) == (bool(expected), expected), (
            f"manifest #{i} (seed {SEED}): python {sorted(expected)} vs apiserver {proc.stderr}"
        )
        refused += bool(expected)
    assert 0 < refused < N  # both outcomes exercised
