"""Golden and error tests of the pure node-pool expansion (e2e/controlplane/nodes.py); no cluster needed."""

from __future__ import annotations

import pytest

from e2e.controlplane.cluster import DEFAULT_NODES
from e2e.controlplane.nodes import NodePool, load_pools, node_objects, parse_pools


def test_node_objects_golden() -> None:
    pool = NodePool(
        prefix="gb",
        count=2,
        arch="arm64",
        capacity={"nvidia.com/gpu": "4"},
        labels={"nvidia.com/gpu.family": "blackwell"},
        per_node_labels=[{"from": 1, "to": 2, "labels": {"nvidia.com/gpu.clique": "u.1"}}],
        taints=[{"key": "gpu", "value": "true", "effect": "NoSchedule"}],
    )
    assert node_objects([pool]) == [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": f"gb-{i}",
                "labels": {
                    "kubernetes.io/hostname": f"gb-{i}",
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "arm64",
                    "type": "kwok",
                    "nvidia.com/gpu.family": "blackwell",
                    **({"nvidia.com/gpu.clique": "u.1"} if i == 1 else {}),
                },
                "annotations": {"kwok.x-k8s.io/node": "fake"},
            },
            "spec": {"taints": [{"key": "gpu", "value": "true", "effect": "NoSchedule"}]},
            "status": {
                "capacity": {"nvidia.com/gpu": "4"},
                "allocatable": {"nvidia.com/gpu": "4"},
                "nodeInfo": {"architecture": "arm64", "operatingSystem": "linux"},
            },
        }
        for i in range(2)
    ]


def test_default_nodes_cover_the_examples() -> None:
    nodes = node_objects(load_pools(DEFAULT_NODES))
    gb300 = [n for n in nodes if n["metadata"]["labels"].get("nvidia.com/gpu.product") == "NVIDIA-GB300"]
    h100 = [n for n in nodes if n["metadata"]["labels"].get("nvidia.com/gpu.family") == "hopper"]
    assert len(gb300) >= 16 and all(n["status"]["capacity"]["nvidia.com/gpu"] == "4" for n in gb300)
    cliques: dict[str, int] = {}
    for n in gb300:
        clique = n["metadata"]["labels"]["nvidia.com/gpu.clique"]
        cliques[clique] = cliques.get(clique, 0) + 1
    assert len(cliques) == 2 and min(cliques.values()) >= 8  # 8 rollout or 8 trainer trays in one domain
    assert {"rdma/ib" in n["status"]["capacity"] for n in h100} == {True, False}
    assert len({n["metadata"]["name"] for n in nodes}) == len(nodes)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"nodes": []}, "`pools:` list"),
        ({"pools": [{"prefix": "a", "count": 1}]}, "pools[0]: `capacity` is required"),
        ({"pools": [{"prefix": "a", "count": 1, "capacity": {}, "arch": "s390x"}]}, "pools[0].arch"),
        ({"pools": [{"prefix": "a", "count": -1, "capacity": {}}]}, "pools[0].count"),
        ({"pools": [{"prefix": "a", "count": 1, "capacity": {}, "gpus": 8}]}, "unknown fields ['gpus']"),
    ],
)
def test_bad_pools_name_the_field(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        parse_pools(doc, source="t.yaml")
