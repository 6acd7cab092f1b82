"""NetworkPolicy builders: who may reach a job's rank, engine and driver pods (least privilege).

Why it exists: trainer rank 0 serves the RL steps on its control port (29600, `lockstep trainer
--serve`); anything that reaches it can drive the optimizer. So only the job's driver pod may reach
that port. The ranks still need each other (torch.distributed's TCPStore on the rendezvous port
29500, then NCCL/gloo on ports the OS picks: NCCL has no setting that pins them, NVIDIA/nccl#388),
and the job's engines join the trainer's weight-update group (TCPStore on a free port of trainer
rank 0, then NCCL), so both get every TCP port except the control port. Traffic from anything else is refused once a policy selects
the pods. Egress is not restricted (ranks pull checkpoints and push weights to the engines).
Every policy admits the `metrics` port (9400) from any source: Prometheus runs wherever the cluster
runs it, and that port serves only read-only /metrics text (no route that acts, no secret).
RDMA (InfiniBand verbs, EFA) does not go through the pod network and is not governed by it.

A pod no policy selects takes any traffic, and a job's pods are created before their own policies
(the pods are what a user waits for). So every namespace with jobs holds a baseline policy selecting
every driver, engine and trainer pod and admitting only the metrics port: a pod created before its
own policy is closed, not open, until it comes. Policies add up (a pod takes what any of them
admits), and each job policy admits the metrics port too, so the baseline never widens or narrows
what a job's policies allow once they exist (docs/operator.md, "Reconcile order").

Who calls it: the TrainerGroup, RolloutPool and RLJob reconciles, after their pods; the baseline before
any pod. The label selectors are the ones the pods carry (resources.pods.selector_labels).
"""

from __future__ import annotations

from lockstep_operator.resources.common import (
    BASELINE_NETWORK_POLICY,
    CONTROL_PORT,
    ENGINE_PORT,
    LABEL_JOB,
    LABEL_POOL_CLIENT,
    LABEL_ROLE,
    METRICS_PORT,
    Manifest,
    Owner,
    driver_network_policy_name,
    engine_network_policy_name,
    job_labels,
    metadata,
    network_policy_name,
    teacher_client_label,
)
from lockstep_operator.resources.pods import selector_labels

MAX_PORT = 65535


def _scrape() -> Manifest:
    """The ingress rule of every job pod's metrics port: any source, that port only (Prometheus)."""
    return {"ports": [{"protocol": "TCP", "port": METRICS_PORT}]}


def _all_but_control() -> list[Manifest]:
    """Every TCP port except the control port, as two port ranges (endPort, GA since Kubernetes 1.25)."""
    return [
        {"protocol": "TCP", "port": 1, "endPort": CONTROL_PORT - 1},
        {"protocol": "TCP", "port": CONTROL_PORT + 1, "endPort": MAX_PORT},
    ]


BASELINE_ROLES = ("driver", "engine", "trainer")
"""The pod roles the baseline selects: those whose own policies a pass applies after their pods. Other
pods of a job (a sandbox, an adapter unload) get their policy or their closed shape with them."""


def baseline_network_policy(namespace: str) -> Manifest:
    """The namespace's baseline: every driver, engine and trainer pod of any job or standalone pool
    takes ingress on the metrics port only, until its own policy admits more. Owned by nothing (it
    serves every job of the namespace, and outlives them; deleting it is safe once no job is left)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": BASELINE_NETWORK_POLICY,
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/name": "lockstep",
                "app.kubernetes.io/part-of": "lockstep",
                "app.kubernetes.io/managed-by": "lockstep-operator",
            },
        },
        "spec": {
            "podSelector": {
                "matchExpressions": [
                    {"key": LABEL_JOB, "operator": "Exists"},
                    {"key": LABEL_ROLE, "operator": "In", "values": list(BASELINE_ROLES)},
                ]
            },
            "policyTypes": ["Ingress"],
            "ingress": [_scrape()],
        },
    }


def trainer_network_policy(
    owner: Owner, *, job: str, trainer: str, pool: str, pool_job: str | None = None
) -> Manifest:
    """Ingress of trainer `trainer`'s rank pods: control port from the driver only; the rest from
    the group's own ranks and the pool `pool`'s engines (whose job label is `pool_job`: a standalone
    pool's own name; default the job)."""
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
                        {"podSelector": {"matchLabels": selector_labels(pool_job or job, pool=pool)}},
                    ],
                    "ports": _all_but_control(),
                },
                _scrape(),
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
                _scrape(),
            ],
        },
    }


def shared_engine_network_policy(owner: Owner, *, pool: str, teacher: bool = False) -> Manifest:
    """Ingress of a standalone pool's engine pods (no job owns them): every TCP port from the pool's own
    engines, and from its clients: a rollout pool's are the driver and trainer pods of the jobs that
    use it (label pool-client=<pool>, set by rollout.poolRef), on every TCP port (weight updates); a
    teacher pool's (`teacher`) are the driver pods of the jobs it teaches (label
    teacher-client.rl.lockstep.dev/<pool>, set by a teacher's poolRef), on the HTTP port only: they
    score, nothing writes to a teacher. No job's pods otherwise."""
    engines = {"podSelector": {"matchLabels": selector_labels(pool, pool=pool)}}
    all_ports = [{"protocol": "TCP", "port": 1, "endPort": MAX_PORT}]
    if teacher:
        readers = {"podSelector": {"matchLabels": {teacher_client_label(pool): "true"}}}
        ingress = [
            {"from": [readers], "ports": [{"protocol": "TCP", "port": ENGINE_PORT}]},
            {"from": [engines], "ports": all_ports},
        ]
    else:
        clients = {"podSelector": {"matchLabels": {LABEL_POOL_CLIENT: pool}}}
        ingress = [{"from": [clients, engines], "ports": all_ports}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(owner, engine_network_policy_name(pool), job_labels(pool, "engine", pool=pool)),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(pool, pool=pool)},
            "policyTypes": ["Ingress"],
            "ingress": [*ingress, _scrape()],
        },
    }


def driver_network_policy(owner: Owner, *, job: str) -> Manifest:
    """Ingress of the driver pod: its metrics port only. Its session server and agents talk over
    loopback, and it reaches out (engines, trainer, its progress ConfigMap); nothing else connects in."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(owner, driver_network_policy_name(job), job_labels(job, "driver")),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(job, driver=True)},
            "policyTypes": ["Ingress"],
            "ingress": [_scrape()],
        },
    }
