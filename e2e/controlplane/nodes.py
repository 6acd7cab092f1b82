"""The simulated nodes of the local control plane: pools declared in e2e/nodes.yaml, expanded to Nodes.

Why: tests need GPU nodes (H100 HGX, GB300 trays, CPU nodes) with realistic labels and extended
resources so the scheduler and the operator's placement logic run for real. kwok plays their kubelets.
Who calls it: ControlPlane.start() (the default pools) and tests, through `cluster.add_nodes(...)`.
`node_objects` is pure (golden-tested); `add_nodes` is the I/O edge.
"""

from __future__ import annotations

import urllib.error
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from e2e.controlplane.cluster import ControlPlane

ARCHES = ("amd64", "arm64")
_POOL_KEYS = {"prefix", "count", "arch", "labels", "capacity", "taints", "per_node_labels"}


@dataclass(slots=True)
class NodePool:
    """`count` identical simulated nodes named <prefix>-<i>."""

    prefix: str
    """Name prefix; node i is <prefix>-<i>. Must be a DNS label start (lowercase, digits, '-')."""
    count: int
    """How many nodes."""
    capacity: dict[str, str]
    """Resource capacity, also used as allocatable, e.g. {"cpu": "192", "nvidia.com/gpu": "8"}."""
    arch: str = "amd64"
    """kubernetes.io/arch label and status.nodeInfo.architecture (amd64 or arm64)."""
    labels: dict[str, str] = field(default_factory=dict)
    """Labels on every node of the pool (over the standard ones)."""
    taints: list[dict[str, str]] = field(default_factory=list)
    """Node spec.taints entries ({key, value, effect})."""
    per_node_labels: list[dict[str, Any]] = field(default_factory=list)
    """[{from: i, to: j, labels: {...}}]: extra labels on nodes i..j-1 (e.g. the NVLink clique)."""
    start: int = 0
    """Index of the first node (add a pool with start=N to extend an existing prefix)."""

    def names(self) -> list[str]:
        return [f"{self.prefix}-{i}" for i in range(self.start, self.start + self.count)]


def parse_pools(data: Any, source: str = "nodes") -> list[NodePool]:
    """Validate the `pools:` document of e2e/nodes.yaml; errors name the pool and the field to fix."""
    if not isinstance(data, dict) or not isinstance(data.get("pools"), list):
        raise ValueError(f"{source}: expected a mapping with a `pools:` list")
    pools = []
    for i, raw in enumerate(data["pools"]):
        where = f"{source}: pools[{i}]"
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected a mapping")
        unknown = set(raw) - _POOL_KEYS
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}; allowed: {sorted(_POOL_KEYS)}")
        for key in ("prefix", "count", "capacity"):
            if key not in raw:
                raise ValueError(f"{where}: `{key}` is required")
        arch = raw.get("arch", "amd64")
        if arch not in ARCHES:
            raise ValueError(f"{where}.arch: {arch!r} is not one of {ARCHES}")
        if not isinstance(raw["count"], int) or raw["count"] < 0:
            raise ValueError(f"{where}.count: must be a non-negative integer, got {raw['count']!r}")
        pools.append(
            NodePool(
                prefix=str(raw["prefix"]),
                count=raw["count"],
                arch=arch,
                labels={str(k): str(v) for k, v in (raw.get("labels") or {}).items()},
                capacity={str(k): str(v) for k, v in raw["capacity"].items()},
                taints=list(raw.get("taints") or []),
                per_node_labels=list(raw.get("per_node_labels") or []),
            )
        )
    return pools


def load_pools(path: Path) -> list[NodePool]:
    """Read and validate a nodes YAML file (the form of e2e/nodes.yaml)."""
    return parse_pools(yaml.safe_load(Path(path).read_text()), source=str(path))


def node_objects(pools: list[NodePool]) -> list[dict[str, Any]]:
    """The Node objects (with status) for the pools, in order. Pure: same pools, same objects."""
    objects = []
    for pool in pools:
        for index, name in enumerate(pool.names(), start=pool.start):
            labels = {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": pool.arch,
                "type": "kwok",
                **pool.labels,
            }
            for extra in pool.per_node_labels:
                if int(extra["from"]) <= index < int(extra["to"]):
                    labels.update({str(k): str(v) for k, v in extra["labels"].items()})
            node: dict[str, Any] = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": labels,
                    # kwok.x-k8s.io/node=fake marks the node as simulated for people reading `kubectl get`.
                    "annotations": {"kwok.x-k8s.io/node": "fake"},
                },
                "spec": {"taints": pool.taints} if pool.taints else {},
                "status": {
                    "capacity": dict(pool.capacity),
                    "allocatable": dict(pool.capacity),
                    "nodeInfo": {"architecture": pool.arch, "operatingSystem": "linux"},
                },
            }
            objects.append(node)
    return objects


def create_nodes(cluster: ControlPlane, pools: list[NodePool]) -> list[str]:
    """POST the pools' Node objects (status included); a node that already exists is left as it is,
    so status set by a test is not overwritten. Returns all the pools' node names."""
    objects = node_objects(pools)

    def create(node: dict[str, Any]) -> None:
        try:
            cluster.api_request("POST", "/api/v1/nodes", node)
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # 409 AlreadyExists: keep the existing node
                raise

    # A few at a time: each request is a fresh TLS connection, which dominates on a loaded machine.
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(create, objects))
    return [o["metadata"]["name"] for o in objects]


def wait_nodes_ready(cluster: ControlPlane, names: list[str], timeout: float = 60.0) -> None:
    """Wait until kwok made every named node Ready and the not-ready taint is lifted."""

    def pending() -> list[str]:
        nodes = {n["metadata"]["name"]: n for n in cluster.api_get("/api/v1/nodes")["items"]}
        return [name for name in names if not _is_ready(nodes.get(name))]

    try:
        cluster.wait_for(lambda: not pending(), timeout=timeout, what="nodes Ready")
    except TimeoutError as exc:
        raise TimeoutError(f"nodes not Ready/schedulable after {timeout:.0f} s: {pending()}") from exc


def add_nodes(cluster: ControlPlane, pools: list[NodePool], timeout: float = 60.0) -> list[str]:
    """Create the pools' nodes (with status) and wait until every one is Ready and schedulable."""
    names = create_nodes(cluster, pools)
    wait_nodes_ready(cluster, names, timeout=timeout)
    return names


def _is_ready(node: dict[str, Any] | None) -> bool:
    if node is None:
        return False
    conditions = node.get("status", {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    # The node-lifecycle controller lifts this taint (added at creation) after Ready: until then
    # nothing schedules there.
    taints = node.get("spec", {}).get("taints") or []
    return ready and not any(t.get("key") == "node.kubernetes.io/not-ready" for t in taints)
