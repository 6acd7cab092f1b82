"""NetworkPolicy builder: who may reach a trainer group's rank pods (least privilege).

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
    Manifest,
    Owner,
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
