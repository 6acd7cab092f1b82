"""Job-level placement: pick the trainer's NVLink domain before any pod exists, keep engines out of it.

Why it exists: the trainer ranks want one NVLink domain (nvidia.com/gpu.clique). If the trainer and
the engines are created at the same time, the engines may land in the domain first and leave the
ranks pending forever (a partial gang). So the RLJob reconcile decides once, before creating the
children: the clique with room for every rank (topology.pick_clique over observed nodes and GPU use),
and, when the engines fit elsewhere, a NotIn rule keeping engines out of it. The choice is stored in
annotations on the TrainerGroup (rl.lockstep.dev/clique) and the RolloutPool
(rl.lockstep.dev/avoid-clique) and never recomputed.

Who calls it: reconcile.rljob (and reconcile.trainergroup for a TrainerGroup created by hand).
"""

from __future__ import annotations

from lockstep_operator.k8s.client import KubeClient
from lockstep_operator.resources.pods import GPU
from lockstep_operator.topology import CLIQUE_LABEL, PRODUCT_LABEL, NodeFacts, parse_count, pick_clique


async def gpu_usage(kube: KubeClient) -> tuple[list[NodeFacts], dict[str, int]]:
    """All nodes, and GPUs requested per node by pods that are not finished."""
    nodes = [NodeFacts.from_node(n) for n in await kube.list("v1", "Node", None)]
    used: dict[str, int] = {}
    for pod in await kube.list("v1", "Pod", None):
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for c in pod["spec"].get("containers", []):
            requests = (c.get("resources") or {}).get("requests") or {}
            used[node] = used.get(node, 0) + parse_count(requests.get(GPU, "0"))
    return nodes, used


def engines_fit_outside(
    nodes: list[NodeFacts],
    used: dict[str, int],
    *,
    product: str | None,
    clique: str,
    replicas: int,
    gpus: int,
) -> bool:
    """Whether `replicas` engines of `gpus` GPUs fit on matching nodes outside `clique` (pure)."""
    if gpus == 0:
        return True
    slots = 0
    for n in nodes:
        if (product and n.labels.get(PRODUCT_LABEL) != product) or n.labels.get(CLIQUE_LABEL) == clique:
            continue
        slots += max(n.gpus - used.get(n.name, 0), 0) // gpus
    return slots >= replicas


async def plan_cliques(
    kube: KubeClient,
    *,
    product: str | None,
    ranks: int,
    gpus_per_rank: int,
    engines: int,
    gpus_per_engine: int,
) -> tuple[str, str]:
    """(trainer clique, clique engines avoid); "" for none."""
    if gpus_per_rank == 0:
        return "", ""
    nodes, used = await gpu_usage(kube)
    if not any(CLIQUE_LABEL in n.labels for n in nodes):
        return "", ""
    choice = pick_clique(nodes, product=product, ranks=ranks, gpus_per_rank=gpus_per_rank, used=used)
    if choice.clique is None:
        return "", ""
    fits = engines_fit_outside(
        nodes, used, product=product, clique=choice.clique, replicas=engines, gpus=gpus_per_engine
    )
    return choice.clique, choice.clique if fits else ""
