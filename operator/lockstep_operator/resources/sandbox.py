"""The sandboxes of an RLJob with spec.agent.sandbox: a SandboxTemplate, a SandboxWarmPool and the
driver's right to claim from it (kubernetes-sigs/agent-sandbox, docs/sandbox.md).

Why it exists: every episode of an agentic job runs in its own sandbox pod. The operator owns the
blueprint (the template: the task image, requests equal to limits, PSS restricted, no service-account
token, an empty working directory, the job's placement, and a NetworkPolicy that denies all ingress
and, by default, all egress) and a warm pool of ready pods sized from the rollout concurrency; both
carry the job's owner reference, so deleting the job deletes them and, through their owner
references, every sandbox and pod. The driver claims one sandbox per episode (SandboxClaim) and runs
commands through the Kubernetes API (pods/exec), so its Role grants exactly that.

Called by the RLJob reconcile; golden-tested. Pure.
"""

from __future__ import annotations

import shlex
from typing import Final

from lockstep.api.rljob import RLJobSpec, ScheduleMode
from lockstep.api.sandbox import SandboxSpec, sandbox_concurrency, warm_pool_size

from lockstep_operator.resources.common import Manifest, Owner, driver_name, job_labels, metadata

EXTENSIONS_API: Final = "extensions.agents.x-k8s.io/v1beta1"
"""agent-sandbox's extensions group: SandboxTemplate, SandboxWarmPool, SandboxClaim."""
SANDBOX_API_GROUP: Final = "agents.x-k8s.io"
"""agent-sandbox's core group: Sandbox."""
SANDBOX_USER: Final = 65534
"""The sandbox's user and group (nobody): PSS restricted needs a non-root user, and a task image's
root user is not one."""
WORKSPACE_VOLUME: Final = "workspace"
WARMPOOL_ENV: Final = "LOCKSTEP_SANDBOX_WARMPOOL"
"""The driver pod's variable naming the job's SandboxWarmPool (lockstep.driver.sandboxes reads it)."""
POD_UID_ENV: Final = "LOCKSTEP_POD_UID"
"""The driver pod's own UID (downward API): its claims' owner reference."""


SANDBOX_OF_LABEL: Final = "rl.lockstep.dev/sandbox-of"
"""The label of a job's sandbox pods, naming the job. Not rl.lockstep.dev/job: the operator watches
pods with that label and reconciles their job on every event, which a churn of sandboxes must not do."""


def sandbox_pod_labels(job: str) -> dict[str, str]:
    """The labels of the job's sandbox pods (tests and the driver's cleanup select by them)."""
    return {"app.kubernetes.io/part-of": "lockstep", "app.kubernetes.io/instance": job, SANDBOX_OF_LABEL: job}


def sandbox_name(job: str) -> str:
    """The job's SandboxTemplate and SandboxWarmPool (one name for both)."""
    return f"{job}-sandbox"


def job_concurrency(spec: RLJobSpec) -> int:
    """Sandboxes the job claims at once (lockstep.api.sandbox_concurrency over its spec)."""
    assert spec.agent.sandbox is not None
    return sandbox_concurrency(
        sandbox=spec.agent.sandbox,
        max_in_flight=spec.rollout.max_in_flight,
        samples_per_step=spec.algorithm.batch_size * spec.algorithm.samples_per_prompt,
        fully_async=spec.schedule.mode is ScheduleMode.FULLY_ASYNC,
    )


def sandbox_manifests(owner: Owner, spec: RLJobSpec) -> list[Manifest]:
    """The template, the warm pool and the driver's claim Role of a job with a sandbox; [] without."""
    box = spec.agent.sandbox
    if box is None:
        return []
    job = owner.name
    labels = {**job_labels(job), "rl.lockstep.dev/role": "sandbox"}
    name = sandbox_name(job)
    template = {
        "apiVersion": EXTENSIONS_API,
        "kind": "SandboxTemplate",
        "metadata": metadata(owner, name, labels),
        "spec": {
            "podTemplate": {
                "metadata": {"labels": sandbox_pod_labels(job)},
                "spec": sandbox_pod_spec(box, spec),
            },
            "networkPolicyManagement": "Managed",
            # Ingress: nothing (commands arrive through the API server and the kubelet, not the pod
            # network). Egress: nothing unless allowed; an empty list is agent-sandbox's deny-all.
            "networkPolicy": {"ingress": [], "egress": [{}] if box.egress == "allow" else []},
        },
    }
    pool = {
        "apiVersion": EXTENSIONS_API,
        "kind": "SandboxWarmPool",
        "metadata": metadata(owner, name, labels),
        "spec": {
            "replicas": warm_pool_size(box, job_concurrency(spec)),
            "sandboxTemplateRef": {"name": name},
        },
    }
    return [template, pool, *claim_rbac(owner, job)]


def sandbox_pod_spec(box: SandboxSpec, spec: RLJobSpec) -> Manifest:
    """The sandbox pod: the image idles in its working directory until commands arrive by exec."""
    res = box.resources
    amounts = {"cpu": res.cpu, "memory": res.memory, "ephemeral-storage": res.ephemeral_storage}
    idle = f"cd {shlex.quote(box.working_dir)} && while :; do sleep 3600; done"
    return {
        "automountServiceAccountToken": False,  # a sandbox never calls the Kubernetes API
        "enableServiceLinks": False,
        "restartPolicy": "Never",  # a sandbox that dies is gone: its episode is aborted, not retried in it
        "terminationGracePeriodSeconds": 0,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": SANDBOX_USER,
            "runAsGroup": SANDBOX_USER,
            "fsGroup": SANDBOX_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": "sandbox",
                "image": box.image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", idle],
                "workingDir": box.working_dir,
                "resources": {"requests": dict(amounts), "limits": dict(amounts)},
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": [{"name": WORKSPACE_VOLUME, "mountPath": box.working_dir}],
            }
        ],
        "volumes": [{"name": WORKSPACE_VOLUME, "emptyDir": {"sizeLimit": res.ephemeral_storage}}],
        "nodeSelector": dict(spec.placement.node_selector),
        "tolerations": [t.wire() for t in spec.placement.tolerations],
    }


CLAIM_RULES: Final[tuple[tuple[str, str, tuple[str, ...]], ...]] = (
    ("extensions.agents.x-k8s.io", "sandboxclaims", ("create", "get", "list", "watch", "delete")),
    ("", "pods", ("get",)),
    ("", "pods/exec", ("create", "get")),
)
"""(API group, resource, verbs) the driver's provider (lockstep.sandbox.cluster) uses, and no more:
a claim is created, watched (or read) until Ready, listed by label once at start (a restarted driver
deletes its job's leftovers) and deleted at release (its Sandbox's pod has the Sandbox's name in
agent-sandbox v1.0.1: the Sandbox is never read); the pod is read
after a command died by a signal (is it gone?); commands run through pods/exec, a websocket upgrade
of a GET that the API server authorizes as both `get` and `create`. manifests/rbac.yaml grants the
operator the same (it may grant only what it holds; operator/tests/test_sandbox_rbac.py keeps them
equal)."""


def claim_rbac(owner: Owner, job: str) -> list[Manifest]:
    """Role and RoleBinding letting the driver's ServiceAccount claim sandboxes and exec into them
    (exactly CLAIM_RULES)."""
    name = f"{driver_name(job)}-sandbox"
    labels = job_labels(job, "driver")
    rules = [{"apiGroups": [g], "resources": [r], "verbs": list(v)} for g, r, v in CLAIM_RULES]
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(owner, name, labels),
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(owner, name, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": driver_name(job), "namespace": owner.namespace}],
        },
    ]
