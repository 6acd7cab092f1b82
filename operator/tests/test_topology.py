"""Golden tests of the transport choice (§7.2.5) and of NVLink-domain packing."""

from __future__ import annotations

from lockstep_operator.topology import NodeFacts, choose_transport, parse_count, pick_clique


def node(
    name: str,
    *,
    rdma: bool = False,
    network: str | None = None,
    clique: str | None = None,
    gpus: int = 8,
    product: str = "NVIDIA-H100-80GB-HBM3",
) -> NodeFacts:
    labels = {"nvidia.com/gpu.product": product}
    if network:
        labels["rl.lockstep.dev/network"] = network
    if clique:
        labels["nvidia.com/gpu.clique"] = clique
    alloc = {"nvidia.com/gpu": str(gpus), "cpu": "64"}
    if rdma:
        alloc["rdma/ib"] = "1"
    return NodeFacts(name, labels, alloc)


def test_colocated_is_cuda_ipc() -> None:
    n = [node("a")]
    d = choose_transport(n, n, colocated=True, shared_volume=False)
    assert d.transport == "cuda-ipc"
    assert "colocated" in d.reason


def test_rdma_two_nodes_per_side_is_p2p() -> None:
    t = [node("t1", rdma=True), node("t2", rdma=True)]
    e = [node("e1", rdma=True), node("e2", rdma=True)]
    d = choose_transport(t, e, colocated=False, shared_volume=False)
    assert (d.transport, d.feasible) == ("p2p", ("p2p", "broadcast"))


def test_stock_sglang_engines_never_get_p2p_and_a_request_says_why() -> None:
    """Stock SGLang has no P2P receive side: RDMA everywhere still means broadcast, and an explicit p2p
    is rejected with the fix (declare rollout.p2pReceiver)."""
    t = [node("t1", rdma=True), node("t2", rdma=True)]
    e = [node("e1", rdma=True), node("e2", rdma=True)]
    d = choose_transport(t, e, colocated=False, shared_volume=False, requested="p2p", engine_p2p=False)
    assert (d.transport, d.feasible) == ("broadcast", ("broadcast",))
    assert d.override_rejected is not None and "rollout.p2pReceiver" in d.override_rejected


def test_rdma_but_one_node_per_side_is_broadcast() -> None:
    t = [node("t1", rdma=True)]
    e = [node("e1", rdma=True), node("e2", rdma=True)]
    d = choose_transport(t, e, colocated=False, shared_volume=False)
    assert d.transport == "broadcast"


def test_missing_rdma_on_one_node_is_broadcast_and_p2p_request_rejected_with_name() -> None:
    t = [node("t1", rdma=True), node("t2", rdma=True)]
    e = [node("e1", rdma=True), node("e2")]
    d = choose_transport(t, e, colocated=False, shared_volume=False, requested="p2p")
    assert d.transport == "broadcast"
    assert d.override_rejected is not None and "e2" in d.override_rejected


def test_separate_networks_with_shared_volume_is_disk_delta() -> None:
    t = [node("t1", network="a")]
    e = [node("e1", network="b")]
    d = choose_transport(t, e, colocated=False, shared_volume=True)
    assert d.transport == "disk-delta"
    assert d.feasible == ("disk-delta",)


def test_separate_networks_without_volume_is_infeasible_with_reasons() -> None:
    d = choose_transport(
        [node("t1", network="a")], [node("e1", network="b")], colocated=False, shared_volume=False
    )
    assert d.transport is None
    assert "different networks" in d.reason and "ReadWriteMany" in d.reason


def test_explicit_feasible_transport_wins() -> None:
    t = [node("t1", rdma=True), node("t2", rdma=True)]
    e = [node("e1", rdma=True), node("e2", rdma=True)]
    d = choose_transport(t, e, colocated=False, shared_volume=True, requested="disk-delta")
    assert d.transport == "disk-delta" and d.override_rejected is None


def test_unscheduled_waits() -> None:
    d = choose_transport([], [node("e1")], colocated=False, shared_volume=True)
    assert d.transport is None and "waiting" in d.reason


def test_from_node_and_quantities() -> None:
    facts = NodeFacts.from_node(
        {
            "metadata": {"name": "n", "labels": {"a": "b"}},
            "status": {"allocatable": {"vpc.amazonaws.com/efa": "4"}},
        }
    )
    assert facts.has_rdma and facts.gpus == 0 and facts.network == "cluster"
    assert parse_count("2k") == 2000 and parse_count("junk") == 0


def test_pick_clique_best_fit() -> None:
    nodes = [
        node("a1", clique="c.1", gpus=4, product="NVIDIA-GB300"),
        node("a2", clique="c.1", gpus=4, product="NVIDIA-GB300"),
        node("b1", clique="c.2", gpus=4, product="NVIDIA-GB300"),
        node("b2", clique="c.2", gpus=4, product="NVIDIA-GB300"),
        node("b3", clique="c.2", gpus=4, product="NVIDIA-GB300"),
        node("h", gpus=8),
    ]
    # Two ranks of 4 GPUs: both cliques fit; c.1 is the tighter fit.
    assert pick_clique(nodes, product="NVIDIA-GB300", ranks=2, gpus_per_rank=4, used={}).clique == "c.1"
    # a1 busy: only c.2 still has room for 2 ranks.
    assert (
        pick_clique(nodes, product="NVIDIA-GB300", ranks=2, gpus_per_rank=4, used={"a1": 2}).clique == "c.2"
    )
    none = pick_clique(nodes, product="NVIDIA-GB300", ranks=4, gpus_per_rank=4, used={})
    assert none.clique is None and "no NVLink domain" in none.reason
    h100 = pick_clique(nodes, product="NVIDIA-H100-80GB-HBM3", ranks=1, gpus_per_rank=8, used={})
    assert h100.clique is None and "not packed" in h100.reason


def test_engines_fit_outside_the_trainer_clique() -> None:
    from lockstep_operator.reconcile.placement import engines_fit_outside

    nodes = [node(f"a{i}", clique="c.1", gpus=4, product="NVIDIA-GB300") for i in range(3)]
    nodes += [node(f"b{i}", clique="c.2", gpus=4, product="NVIDIA-GB300") for i in range(2)]
    assert engines_fit_outside(nodes, {}, product="NVIDIA-GB300", clique="c.1", replicas=2, gpus=4)
    assert not engines_fit_outside(nodes, {"b0": 1}, product="NVIDIA-GB300", clique="c.1", replicas=2, gpus=4)
    assert engines_fit_outside(nodes, {}, product=None, clique="c.1", replicas=4, gpus=2)
