"""NetworkPolicy builders: who may reach a job's rank, engine and driver pods (least privilege).

Why it exists: trainer rank 0 serves the RL steps on its control port (29600, `lockstep trainer
--serve`); anything that reaches it can drive the optimizer. So only the job's driver pod may reach
that port. The ranks still need each other (torch.distributed's TCPStore on the rendezvous port
29500, then NCCL/gloo on ports the OS picks: NCCL has no setting that pins them, NVIDIA/nccl#388),
and the job's engines join the trainer's weight-update group (TCPStore on a free port of trainer
rank 0, then NCCL), so both get every TCP port except the control port. Traffic from anything else is refused once a policy selects
the pods. Egress is not restricted (ranks pull checkpoints and push weights to the engines).
RDMA (InfiniBand verbs, EFA) does not go through the pod network and is not governed by it.

Who calls it: the TrainerGroup reconcile, next to the headless Service. The label selectors are the
ones the pods carry (resources.pods.selector_labels).
"""

from __future__ import annotations

from lockstep_operator.resources.common import (
    CONTROL_PORT,
    ENGINE_PORT,
    Manifest,
    Owner,
    driver_network_policy_name,
    engine_network_policy_name,
    job_labels,
    metadata,
    network_policy_name,
)
from lockstep_operator.resources.pods import selector_labels

MAX_PORT = 65535


def _all_but_control() -> list[Manifest]:
    """Every TCP port except the control port, as two port ranges (endPort, GA since Kubernetes 1.25)."""
    return [
        {"protocol": "TCP", "port": 1, "endPort": CONTROL_PORT - 1},
        {"protocol": "TCP", "port": CONTROL_PORT + 1, "endPort": MAX_PORT},
    ]


def trainer_network_policy(owner: Owner, *, job: str, trainer: str, pool: str) -> Manifest:
    """Ingress of trainer `trainer`'s rank pods: control port from the driver only; the rest from
    the group's own ranks and the pool `pool`'s engines."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(owner, network_policy_name(trainer), job_labels(job, "trainer")),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(job, trainer=trainer)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": selector_labels(job, driver=True)}}],
                    "ports": [{"protocol": "TCP", "port": CONTROL_PORT}],
                },
                {
                    "from": [
                        {"podSelector": {"matchLabels": selector_labels(job, trainer=trainer)}},
                        {"podSelector": {"matchLabels": selector_labels(job, pool=pool)}},
                    ],
                    "ports": _all_but_control(),
                },
            ],
        },
    }


def engine_network_policy(owner: Owner, *, job: str, pool: str, trainer: str) -> Manifest:
    """Ingress of pool `pool`'s engine pods: the HTTP port from the job's driver (rollouts, sessions)
    and trainer ranks (weight updates); every TCP port from the trainer ranks and the pool's own
    engines (NCCL and Mooncake P2P connect both ways, on ports the OS picks). Kubelet probes are
    node-local and not subject to the policy on common CNIs."""
    trainers = {"podSelector": {"matchLabels": selector_labels(job, trainer=trainer)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(owner, engine_network_policy_name(pool), job_labels(job, "engine", pool=pool)),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(job, pool=pool)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": selector_labels(job, driver=True)}}],
                    "ports": [{"protocol": "TCP", "port": ENGINE_PORT}],
                },
                {
                    "from": [trainers, {"podSelector": {"matchLabels": selector_labels(job, pool=pool)}}],
                    "ports": [{"protocol": "TCP", "port": 1, "endPort": MAX_PORT}],
                },
            ],
        },
    }


def driver_network_policy(owner: Owner, *, job: str) -> Manifest:
    """Ingress of the driver pod: none. Its session server and agents talk over loopback, and it
    reaches out (engines, trainer, its progress ConfigMap); nothing may connect in."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(owner, driver_network_policy_name(job), job_labels(job, "driver")),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(job, driver=True)},
            "policyTypes": ["Ingress"],
            "ingress": [],
        },
    }
