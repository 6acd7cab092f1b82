"""Pytest fixtures of the e2e tests: one real local control plane per session, a fresh namespace per test.

Why: every e2e test (API schema/CEL, operator reconcile, smoke) talks to a real kube-apiserver with
real controllers and a scheduler, and simulated GPU nodes played by kwok. Starting it costs seconds,
so it starts once per pytest session and is torn down at the end, even on failure; teardown fails
the session if a process or a listening port is left.

Fixtures (documented in docs/controlplane.md):
- `cluster` (session): a started `ControlPlane` — .kubeconfig, .bin_dir, .api_url, .admin_token,
  .kubectl(*args, input=None, check=True), .get(...), .apply(manifest), .wait_for(pred, timeout, what),
  .add_nodes(pools), .api_get(path). KUBECONFIG points at its kubeconfig for the whole session.
- `namespace` (function): the name of a fresh namespace, deleted after the test.
- `real_cluster` (session): a second control plane with one real worker node (kubelet, containerd,
  kube-proxy, CoreDNS; e2e/controlplane/realnode.py) where pods run for real; `real_namespace`
  (function) is `namespace` on it. Only the tests that ask for it pay for it; where the machine cannot
  run containers they skip with one line naming what is missing (`real_node_here`, node/probe.py).
Every test under e2e/ is marked `e2e`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.controlplane.cluster import ControlPlane, find_binaries

E2E_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def cluster() -> Iterator[ControlPlane]:
    """The session's control plane. Builds the binaries first if they are missing (build.sh).

    LOCKSTEP_E2E_KEEP=1 keeps its work dir (logs, kubeconfig) after the session for debugging.
    """
    keep = os.environ.get("LOCKSTEP_E2E_KEEP") == "1"
    cp = ControlPlane(bin_dir=find_binaries(), keep_work_dir=keep)
    with pytest.MonkeyPatch.context() as mp:
        cp.start()
        try:
            # kopf, the kubernetes client and a bare kubectl all read KUBECONFIG.
            mp.setenv("KUBECONFIG", str(cp.kubeconfig))
            yield cp
        finally:
            cp.stop()  # raises if a process or a listening port is left: the session errors


@pytest.fixture
def namespace(cluster: ControlPlane) -> Iterator[str]:
    """A fresh namespace `e2e-<8 hex>`; deleted (without waiting) after the test."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    # The pods of a namespace need its default ServiceAccount (ServiceAccount admission).
    cluster.wait_for(
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        timeout=30,
        what=f"ServiceAccount default in namespace {name}",
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def real_node_here() -> None:
    """Skips the test, with the one line saying what is missing, where this machine cannot run a real
    node (node/probe.py: root, cgroup v1, veth/bridge/iptables, runc); LOCKSTEP_REAL_NODE=0 skips,
    =1 makes a missing capability an error."""
    from e2e.controlplane.node.probe import skip_reason

    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def real_cluster(real_node_here: None) -> Iterator[ControlPlane]:
    """A control plane with one real node (no kwok nodes unless a test adds them). Needs root.

    Its stop fails the session if a process, port, veth, cgroup or host iptables change is left.
    """
    keep = os.environ.get("LOCKSTEP_E2E_KEEP") == "1"
    cp = ControlPlane(bin_dir=find_binaries(), keep_work_dir=keep, nodes_file=None, real_node=True)
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture
def real_namespace(real_cluster: ControlPlane) -> Iterator[str]:
    """A fresh namespace on the real-node cluster; deleted (without waiting) after the test."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    real_cluster.kubectl("create", "namespace", name)
    real_cluster.wait_for(
        lambda: (
            real_cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0
        ),
        timeout=30,
        what=f"ServiceAccount default in namespace {name}",
    )
    yield name
    real_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
