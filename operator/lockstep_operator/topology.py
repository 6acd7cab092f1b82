"""Topology: which weight transport fits the nodes a job's pods landed on, with a one-line reason.

Why it exists: how a new policy version travels from the trainer to the rollout engines depends only on
what the two sides share (§7.2.5): the same GPUs (cuda-ipc), an RDMA fabric on >= 2 nodes per
side (p2p), an ordinary network (broadcast) or only a shared volume (disk-delta). The transport changes
the cost of a sync, never the policy semantics, so picking it is a pure decision over observed facts;
an explicit transport wins when feasible, else `Decision.override_rejected` says why (the rules in
order: docs/operator.md, "Weight transport"). Also `pick_clique`, which packs trainer ranks into one
NVLink domain. Called by reconcile.weightchannel (NodeFacts from the Node objects under the pods) and
reconcile.placement.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Transport = Literal["broadcast", "cuda-ipc", "disk-delta", "p2p"]
"""The four transports of the glossary."""

TRANSPORTS: tuple[Transport, ...] = ("broadcast", "cuda-ipc", "disk-delta", "p2p")

RDMA_RESOURCE_PREFIXES = ("rdma/",)
"""Extended resources whose presence means an RDMA NIC (rdma/ib, rdma/rdma_shared_device_a, ...)."""
RDMA_RESOURCES = ("nvidia.com/mlnxnics", "vpc.amazonaws.com/efa")
"""Exact resource names that mean an RDMA NIC (SR-IOV Mellanox NICs, AWS EFA)."""

NETWORK_LABEL = "rl.lockstep.dev/network"
"""Node label naming the GPU network a node is on; nodes with equal values can run NCCL together."""
ZONE_LABEL = "topology.kubernetes.io/zone"
"""Fallback network domain when NETWORK_LABEL is absent."""
NETWORK_KEYS = (NETWORK_LABEL, ZONE_LABEL)
"""The node labels that name a node's network domain, the first present wins (NodeFacts.network);
the pods' network-domain affinity uses the same keys (resources.pods.network_affinity)."""
CLIQUE_LABEL = "nvidia.com/gpu.clique"
"""GPU feature discovery label: equal values are one multi-node NVLink domain."""
PRODUCT_LABEL = "nvidia.com/gpu.product"
"""GPU feature discovery label: the sanitized GPU product name (NVIDIA-H100-80GB-HBM3, NVIDIA-GB300)."""
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What the transport and placement decisions read from one Node object."""

    name: str
    """metadata.name of the Node."""
    labels: Mapping[str, str]
    """metadata.labels of the Node."""
    allocatable: Mapping[str, str]
    """status.allocatable of the Node (quantities as strings, e.g. {"nvidia.com/gpu": "8"})."""

    @property
    def has_rdma(self) -> bool:
        """True when the node advertises a non-zero RDMA resource."""
        for key, value in self.allocatable.items():
            rdma = key.startswith(RDMA_RESOURCE_PREFIXES) or key in RDMA_RESOURCES
            if rdma and parse_count(value) > 0:
                return True
        return False

    @property
    def network(self) -> str:
        """The network domain: NETWORK_LABEL, else the zone, else one cluster-wide domain."""
        return next((self.labels[key] for key in NETWORK_KEYS if self.labels.get(key)), "cluster")

    @property
    def gpus(self) -> int:
        """Allocatable GPUs (0 on CPU nodes)."""
        return parse_count(self.allocatable.get(GPU_RESOURCE, "0"))

    @classmethod
    def from_node(cls, node: Mapping[str, object]) -> NodeFacts:
        """Read the facts from a Node manifest as the API server returns it."""
        meta = node.get("metadata") or {}
        status = node.get("status") or {}
        assert isinstance(meta, Mapping) and isinstance(status, Mapping)
        return cls(
            name=str(meta.get("name", "")),
            labels=dict(meta.get("labels") or {}),
            allocatable=dict(status.get("allocatable") or {}),
        )


def parse_count(quantity: str) -> int:
    """Parse an integer resource quantity ("8", "1k"); extended resources are whole numbers."""
    suffixes = {"k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    try:
        for suffix, factor in suffixes.items():
            if quantity.endswith(suffix):
                return int(float(quantity[: -len(suffix)]) * factor)
        return int(float(quantity))
    except ValueError:
        return 0


@dataclass(frozen=True, slots=True)
class Decision:
    """The transport choice with the reason shown in WeightChannel status."""

    transport: Transport | None
    """The chosen transport; None when nothing is feasible yet (or at all)."""
    reason: str
    """One line, for humans: why this transport (or why none)."""
    feasible: tuple[Transport, ...]
    """Every transport the topology supports, in the automatic order of preference."""
    override_rejected: str | None = None
    """Set when the spec asked for a transport that is not feasible: why not."""


ENGINE_WITHOUT_P2P = (
    "the engines have no P2P receive side (stock SGLang offers none): declare an image that serves "
    "Lockstep's extension with rollout.p2pReceiver: true (docs/sglang.md), or use broadcast"
)


def feasible_transports(
    trainer: Sequence[NodeFacts],
    engines: Sequence[NodeFacts],
    *,
    colocated: bool,
    shared_volume: bool,
    engine_p2p: bool = True,
    no_ipc: str | None = None,
) -> tuple[list[Transport], dict[Transport, str]]:
    """All feasible transports in preference order, and for each infeasible one the reason why not.

    `engine_p2p`: the engines serve the P2P receive side (resources.children.engine_serves_p2p).
    `no_ipc`: why cuda-ipc is out although the spec is colocated (on CPU: resources.colocation)."""
    feasible: list[Transport] = []
    why_not: dict[Transport, str] = {}
    if colocated:
        feasible.append("cuda-ipc")
    else:
        why_not["cuda-ipc"] = no_ipc or "trainer and engines do not share GPUs (spec is not colocated)"
    networks = {n.network for n in trainer} | {n.network for n in engines}
    shared_network = len(networks) == 1
    trainer_hosts, engine_hosts = {n.name for n in trainer}, {n.name for n in engines}
    rdma_everywhere = all(n.has_rdma for n in (*trainer, *engines))
    if not shared_network:
        why_not["p2p"] = why_not["broadcast"] = (
            f"trainer and engines are on different networks {sorted(networks)}"
        )
    if not engine_p2p:
        why_not["p2p"] = ENGINE_WITHOUT_P2P
    elif shared_network and not rdma_everywhere:
        missing = sorted({n.name for n in (*trainer, *engines) if not n.has_rdma})
        why_not["p2p"] = f"nodes without an RDMA resource: {', '.join(missing)}"
    elif shared_network and (len(trainer_hosts) < 2 or len(engine_hosts) < 2):
        why_not["p2p"] = (
            f"p2p needs >= 2 nodes per side (trainer on {len(trainer_hosts)}, engines on {len(engine_hosts)})"
        )
    elif shared_network:
        feasible.append("p2p")
    if shared_network:
        feasible.append("broadcast")
    if shared_volume:
        feasible.append("disk-delta")
    else:
        why_not["disk-delta"] = "no shared ReadWriteMany volume in the spec"
    return feasible, why_not


def choose_transport(
    trainer: Sequence[NodeFacts],
    engines: Sequence[NodeFacts],
    *,
    colocated: bool,
    shared_volume: bool,
    requested: Transport | None = None,
    engine_p2p: bool = True,
    no_ipc: str | None = None,
) -> Decision:
    """Pick the transport for the nodes the trainer ranks and the engines landed on (pure)."""
    if not colocated and (not trainer or not engines):
        return Decision(None, "waiting for trainer and engine pods to be scheduled", ())
    if colocated and not trainer and not engines:
        return Decision(None, "waiting for pods to be scheduled", ())
    feasible, why_not = feasible_transports(
        trainer,
        engines,
        colocated=colocated,
        shared_volume=shared_volume,
        engine_p2p=engine_p2p,
        no_ipc=no_ipc,
    )
    if requested is not None:
        if requested in feasible:
            return Decision(requested, f"{requested} requested in the spec and feasible", tuple(feasible))
        rejected = f"requested transport {requested} is not feasible: {why_not.get(requested, 'unknown')}"
    else:
        rejected = None
    if not feasible:
        reason = "no transport is feasible: " + "; ".join(
            f"{t}: {why_not[t]}" for t in TRANSPORTS if t in why_not
        )
        return Decision(None, reason, (), rejected)
    chosen = feasible[0]
    reason = _auto_reason(chosen, trainer, engines)
    if no_ipc:
        reason = f"{no_ipc}; {reason}"
    return Decision(chosen, reason, tuple(feasible), rejected)


def _auto_reason(chosen: Transport, trainer: Sequence[NodeFacts], engines: Sequence[NodeFacts]) -> str:
    if chosen == "cuda-ipc":
        return "trainer and engines are colocated on the same GPUs"
    if chosen == "p2p":
        hosts = len({n.name for n in trainer}), len({n.name for n in engines})
        return f"RDMA on all nodes, trainer on {hosts[0]} nodes and engines on {hosts[1]} nodes"
    if chosen == "broadcast":
        network = next(iter({n.network for n in (*trainer, *engines)}))
        return f"shared network {network} without RDMA on every node (or < 2 nodes per side)"
    return "no shared GPU network; the shared ReadWriteMany volume carries deltas"


@dataclass(frozen=True, slots=True)
class CliqueChoice:
    """Where the trainer ranks should be packed."""

    clique: str | None
    """The nvidia.com/gpu.clique value to require; None when the product has no NVLink domains or none fits."""
    reason: str
    """One line: why this clique (or why no packing)."""


def pick_clique(
    nodes: Iterable[NodeFacts],
    *,
    product: str | None,
    ranks: int,
    gpus_per_rank: int,
    used: Mapping[str, int],
) -> CliqueChoice:
    """Pick the NVLink domain with enough free GPUs for every rank (best fit, then name order).

    `ranks` pods each request `gpus_per_rank` GPUs and need one node each with that many free;
    `used` maps node name -> GPUs already requested by other pods on it.
    """
    candidates = [n for n in nodes if product is None or n.labels.get(PRODUCT_LABEL) == product]
    cliques: dict[str, list[NodeFacts]] = {}
    for node in candidates:
        if clique := node.labels.get(CLIQUE_LABEL):
            cliques.setdefault(clique, []).append(node)
    if not cliques:
        return CliqueChoice(None, f"no {CLIQUE_LABEL} on {product or 'GPU'} nodes; ranks are not packed")
    fits: list[tuple[int, str]] = []
    for clique, members in cliques.items():
        free = [n.gpus - used.get(n.name, 0) for n in members]
        slots = sum(f // gpus_per_rank for f in free if f >= gpus_per_rank)
        if slots >= ranks:
            fits.append((slots, clique))
    if not fits:
        return CliqueChoice(None, f"no NVLink domain has {ranks} nodes with {gpus_per_rank} free GPUs")
    slots, clique = min(fits)
    return CliqueChoice(clique, f"NVLink domain {clique} has room for {slots} ranks (needs {ranks})")
