"""Pod builders: rollout engine replicas, trainer rank pods and the driver pod.

Why it exists: every pod of a job shares the same skeleton (the rendered config mounted read-only,
GPU requests and placement, gang-scheduling keys, non-root security context) and differs only in its
role's command, env and identity. Called by the RolloutPool, TrainerGroup and RLJob reconciles.

Placement: the GPU product becomes a node selector on nvidia.com/gpu.product, GPU pods tolerate the
usual nvidia.com/gpu taint, and trainer ranks get an extra node selector on nvidia.com/gpu.clique when
the TrainerGroup reconcile packed them into one NVLink domain (lockstep_operator.topology.pick_clique).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lockstep_operator.resources.annotations import Annotation
from lockstep_operator.resources.common import (
    API_KEY_ENV,
    API_KEY_ITEM,
    CONFIG_FILE,
    CONFIG_MOUNT,
    CONTROL_PORT,
    ENGINE_PORT,
    LABEL_JOB,
    LABEL_POOL,
    LABEL_POOL_CLIENT,
    LABEL_ROLE,
    LABEL_TRAINER,
    METRICS_PORT,
    POD_IP_ENV,
    RENDEZVOUS_PORT,
    RUN_MOUNT,
    SHARED_MOUNT,
    WEIGHTS_CURRENT,
    Manifest,
    Owner,
    api_key_secret_name,
    clone,
    config_name,
    driver_name,
    job_labels,
    metadata,
    progress_name,
    trainer_name,
)
from lockstep_operator.resources.model import (
    MODEL_MOUNT,
    MODEL_VOLUME,
    SERVING_MOUNT,
    SERVING_SUBPATH,
    SERVING_VOLUME,
    SHARED_SUBPATH,
    ModelConvert,
    ModelPull,
    convert_command,
    pull_command,
)
from lockstep_operator.resources.platforms import ARCH_LABEL, ImageArchitectureError, NodeFacts
from lockstep_operator.topology import NETWORK_KEYS

GPU = "nvidia.com/gpu"
POD_SECURITY: Manifest = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""Every job pod's securityContext: with each container's allowPrivilegeEscalation false and every
capability dropped, what Pod Security Standards "restricted" asks. The one exception is a rank pod of
a p2p job, which adds IPC_LOCK to pin its RDMA buffers (docs/security.md, "Pod Security")."""
ENGINE_STARTUP_S = 3600
"""How long an engine may take to load its checkpoint before the kubelet restarts it."""
ENGINE_DRAIN_S = 600
"""How long a deleted engine may finish its running requests (the runtime's request timeout)."""
PRODUCT_LABEL = "nvidia.com/gpu.product"
CLIQUE_LABEL = "nvidia.com/gpu.clique"


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a pod may run and what it requests."""

    gpus: int = 0
    """nvidia.com/gpu requested (and limited) per pod; 0 for CPU pods."""
    product: str | None = None
    """Required nvidia.com/gpu.product label value, e.g. NVIDIA-H100-80GB-HBM3; None = any."""
    clique: str | None = None
    """Required nvidia.com/gpu.clique (one NVLink domain); None = no packing."""
    avoid_clique: str | None = None
    """A nvidia.com/gpu.clique to stay out of (engines leave the trainer's NVLink domain to it)."""
    cpu: str | None = None
    """CPU request, e.g. "8"."""
    memory: str | None = None
    """Memory request, e.g. "64Gi"."""
    extra_resources: Mapping[str, str] = field(default_factory=dict)
    """Further requests=limits, e.g. {"rdma/ib": "1"} for RDMA NICs."""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    """Additional node selector from the spec."""
    tolerations: Sequence[Mapping[str, Any]] = ()
    """Additional tolerations from the spec."""
    architectures: Sequence[str] = ()
    """kubernetes.io/arch values the pod's images exist for (resources.platforms); () = no rule."""
    near: Sequence[Mapping[str, str]] = ()
    """Labels of the pods this pod is to share a network domain with (network_affinity)."""


@dataclass(frozen=True, slots=True)
class Gang:
    """How a pod joins the job's gang (see resources.podgroups)."""

    scheduler_name: str | None = None
    """spec.schedulerName (volcano, scheduler-plugins-scheduler); None = the default scheduler."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Labels that make the pod a member (scheduler-plugins, Kueue)."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    """Annotations that make the pod a member (Volcano, Kueue's total count)."""


@dataclass(frozen=True, slots=True)
class Container:
    """What runs in the pod."""

    image: str
    """Container image."""
    command: Sequence[str]
    """Entrypoint and arguments."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Plain environment variables."""
    shared_volume_claim: str | None = None
    """A ReadWriteMany PersistentVolumeClaim mounted at /shared (checkpoints, disk-delta)."""
    image_pull_policy: str = "IfNotPresent"
    """imagePullPolicy."""
    secret_env: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """Env vars read from Secrets: name -> (Secret name, data key); the value never enters the pod spec."""
    shm_size: str | None = None
    """Size of a memory-backed /dev/shm (NCCL, SGLang's and torch's shared-memory transfers); None keeps
    the runtime's 64 MiB default."""
    capabilities: Sequence[str] = ()
    """Linux capabilities added to the dropped-ALL set (IPC_LOCK to pin RDMA buffers)."""
    model: ModelPull | None = None
    """The hub model the pod's init step downloads into the model volume (resources.model); None
    when the checkpoint is local."""
    convert: ModelConvert | None = None
    """The low-precision serving checkpoint an engine pod's init step writes into the serving
    volume (resources.model); None for bf16 serving and for every other role."""


def _resources(p: Placement) -> Manifest:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if p.cpu:
        requests["cpu"] = p.cpu
    if p.memory:
        requests["memory"] = p.memory
    if p.gpus:
        requests[GPU] = limits[GPU] = str(p.gpus)
    for key, value in p.extra_resources.items():
        requests[key] = limits[key] = value
    out: Manifest = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _capabilities(c: Container) -> Manifest:
    caps: Manifest = {"drop": ["ALL"]}
    if c.capabilities:
        caps["add"] = list(c.capabilities)
    return caps


def _pod_spec(c: Container, p: Placement, gang: Gang, *, env: Mapping[str, str], restart: str) -> Manifest:
    selector = dict(p.node_selector)
    if p.product:
        selector[PRODUCT_LABEL] = p.product
    if p.clique:
        selector[CLIQUE_LABEL] = p.clique
    tolerations = [dict(t) for t in p.tolerations]
    if p.gpus:
        # GPU node pools are commonly tainted nvidia.com/gpu:NoSchedule.
        tolerations.append({"key": GPU, "operator": "Exists", "effect": "NoSchedule"})
    mounts = [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}]
    volumes: list[Manifest] = [{"name": "config", "configMap": {"name": env["LOCKSTEP_CONFIG_MAP"]}}]
    if c.shared_volume_claim:
        mounts.append({"name": "shared", "mountPath": SHARED_MOUNT})
        volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": c.shared_volume_claim}})
    all_env: list[Manifest] = [{"name": k, "value": v} for k, v in {**env, **c.env}.items()]
    all_env += [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
        for name, (secret, key) in c.secret_env.items()
    ]
    all_env += [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    model_mount = _model_mount(c) if c.model is not None else None
    if model_mount is not None:
        mounts.append(model_mount)
        if model_mount["name"] == MODEL_VOLUME:
            volumes.append({"name": MODEL_VOLUME, "emptyDir": {}})
    container: Manifest = {
        "name": "main",
        "image": c.image,
        "imagePullPolicy": c.image_pull_policy,
        "command": list(c.command),
        "env": all_env,
        "resources": _resources(p),
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": _capabilities(c)},
    }
    if c.shm_size:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": c.shm_size}})
    spec: Manifest = {
        "restartPolicy": restart,
        "containers": [container],
        "volumes": volumes,
        "enableServiceLinks": False,
        "securityContext": POD_SECURITY,
    }
    inits: list[Manifest] = []
    if c.model is not None and model_mount is not None:
        inits.append(_pull_container(c.model, model_mount, c.image_pull_policy))
    if c.convert is not None:
        serving_mount = _serving_mount(c)
        mounts.append(serving_mount)
        if serving_mount["name"] == SERVING_VOLUME:
            volumes.append({"name": SERVING_VOLUME, "emptyDir": {}})
        reads = [model_mount] if model_mount is not None else []
        inits.append(_convert_container(c.convert, [*reads, serving_mount], c.image_pull_policy))
    if inits:
        spec["initContainers"] = inits
    if selector:
        spec["nodeSelector"] = selector
    if tolerations:
        spec["tolerations"] = tolerations
    if gang.scheduler_name:
        spec["schedulerName"] = gang.scheduler_name
    rules: list[Manifest] = []
    if p.architectures:  # never an image on a node whose architecture it lacks
        rules.append({"key": ARCH_LABEL, "operator": "In", "values": list(p.architectures)})
    if p.avoid_clique:
        rules.append({"key": CLIQUE_LABEL, "operator": "NotIn", "values": [p.avoid_clique]})
    affinity: Manifest = {}
    if rules:
        affinity["nodeAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": rules}]
            }
        }
    if p.near:
        affinity["podAffinity"] = {
            "preferredDuringSchedulingIgnoredDuringExecution": network_affinity(p.near)
        }
    if affinity:
        spec["affinity"] = affinity
    return spec


def network_affinity(near: Sequence[Mapping[str, str]]) -> list[Manifest]:
    """Preferred pod-affinity terms: the network domain (topology.NETWORK_KEYS: the network label, else
    the zone) of the pods `near` selects, for each.

    Why: weight sync needs a network both sides share (broadcast, p2p); left to the resource scores,
    the scheduler put a CPU job's rank and its engine in different zones, and no transport was ever
    feasible. Preferred, not required: a required term on a label the nodes lack would leave every
    pod after the first unschedulable, and a full domain spills over (the WeightChannel then says no
    transport is feasible and why). The first pod of a job lands anywhere; the rest follow it."""
    return [
        {
            "weight": 100,
            "podAffinityTerm": {"labelSelector": {"matchLabels": dict(labels)}, "topologyKey": key},
        }
        for labels in near
        for key in NETWORK_KEYS
    ]


def pod_images(c: Container) -> list[str]:
    """Every image a pod of `c` runs (its main container and init steps)."""
    images = [c.image]
    if c.model is not None:
        images.append(c.model.image)
    if c.convert is not None:
        images.append(c.convert.image)
    return images


def with_architectures(
    p: Placement, c: Container, facts: NodeFacts, sidecars: Sequence[str] = ()
) -> Placement:
    """`p` restricted to the architectures every image of `c` (and the `sidecars` images) exists for;
    raises ImageArchitectureError naming the images when they share none."""
    images = [*pod_images(c), *sidecars]
    arches = facts.pod_architectures(images)
    if not arches:
        found = {image: facts.image_architectures(image) for image in images}
        raise ImageArchitectureError(
            f"the pod's images exist for no common architecture ({found}): declare the images' "
            "architectures in LOCKSTEP_OPERATOR_IMAGE_ARCHITECTURES or use images built for the same ones"
        )
    return dataclasses.replace(p, architectures=arches)


def api_key_env(job: str) -> Manifest:
    """LOCKSTEP_API_KEY from the job's Secret `<job>-api-key` (never a literal in a pod spec)."""
    ref = {"name": api_key_secret_name(job), "key": API_KEY_ITEM}
    return {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": ref}}


def _with_api_key(spec: Manifest, job: str) -> Manifest:
    """The API key of `job`'s engines: its own Secret, or a standalone pool's (`job` = the pool)."""
    spec["containers"][0]["env"].append(api_key_env(job))
    return spec


def _model_mount(c: Container) -> Manifest:
    """Where the model volume is mounted: the shared claim's model directory when the pod has the
    claim (filled once for the job), else the pod's own emptyDir `model`."""
    if c.shared_volume_claim:
        return {"name": "shared", "mountPath": MODEL_MOUNT, "subPath": SHARED_SUBPATH}
    return {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT}


def _serving_mount(c: Container) -> Manifest:
    """Where the converted serving checkpoints are mounted: the shared claim's serving directory
    when the pod has the claim (converted once for the job), else the pod's own emptyDir."""
    if c.shared_volume_claim:
        return {"name": "shared", "mountPath": SERVING_MOUNT, "subPath": SERVING_SUBPATH}
    return {"name": SERVING_VOLUME, "mountPath": SERVING_MOUNT}


def _convert_container(convert: ModelConvert, mounts: list[Manifest], pull_policy: str) -> Manifest:
    """The init step writing the serving checkpoint (after the pull, which it reads from)."""
    return {
        "name": "convert-model",
        "image": convert.image,
        "imagePullPolicy": pull_policy,
        "command": convert_command(convert),
        "volumeMounts": [dict(m) for m in mounts],
        # convert-model's last words (the argument, the fix) become the pod's status message
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }


def _pull_container(pull: ModelPull, mount: Manifest, pull_policy: str) -> Manifest:
    """The init step filling the model volume; the hub token reaches this container only."""
    env: list[Manifest] = []
    if pull.token is not None:
        ref = {"name": pull.token.name, "key": pull.token.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    out: Manifest = {
        "name": "pull-model",
        "image": pull.image,
        "imagePullPolicy": pull_policy,
        "command": pull_command(pull),
        "volumeMounts": [dict(mount)],
        # pull-model's last words (the repo, the cache, the fix) become the pod's status message
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if env:
        out["env"] = env
    return out


def _metrics_port() -> Manifest:
    """The Prometheus port every job pod declares (the PodMonitors select it by name)."""
    return {"name": "metrics", "containerPort": METRICS_PORT}


def _base_env(job: str) -> dict[str, str]:
    return {
        "LOCKSTEP_JOB": job,
        "LOCKSTEP_CONFIG": f"{CONFIG_MOUNT}/{CONFIG_FILE}",
        "LOCKSTEP_CONFIG_MAP": config_name(job),
        "LOCKSTEP_METRICS_PORT": str(METRICS_PORT),
    }


def engine_pod(
    owner: Owner, *, job: str, pool: str, replica: int, container: Container, placement: Placement, gang: Gang
) -> Manifest:
    """Rollout engine replica `replica` of pool `pool`: `<pool>-<replica>`, serving on port 30000.

    As SGLang's docs run it: started once /health answers (loading a large checkpoint takes long, so
    the startup probe allows ENGINE_STARTUP_S); ready while /health_generate can sample a token (SGLang
    waits up to 20 s for it) AND it holds the current weight version: the readiness gate
    rl.lockstep.dev/weights-current is a pod condition the pool reconcile sets from the driver's
    per-engine report, so the router Service only sends rollouts to engines on the current policy.
    Graceful drain: on deletion the pod leaves the Service's endpoints during the preStop pause, then
    SIGTERM makes SGLang answer 503 to health checks and finish its running requests, for up to
    ENGINE_DRAIN_S (the runtime's request timeout) before the kubelet kills it.
    restartPolicy Never: a failed engine is replaced by the pool reconcile (the driver re-syncs it).
    """
    env = {
        **_base_env(job),
        "LOCKSTEP_ROLE": "engine",
        "LOCKSTEP_REPLICA": str(replica),
        "LOCKSTEP_POOL": pool,
    }
    spec = _pod_spec(container, placement, gang, env=env, restart="Never")
    main = spec["containers"][0]
    main["ports"] = [{"name": "http", "containerPort": ENGINE_PORT}, _metrics_port()]
    main["startupProbe"] = {
        "httpGet": {"path": "/health", "port": ENGINE_PORT},
        "periodSeconds": 10,
        "failureThreshold": ENGINE_STARTUP_S // 10,
    }
    main["readinessProbe"] = {
        "httpGet": {"path": "/health_generate", "port": ENGINE_PORT},
        "periodSeconds": 10,
        "timeoutSeconds": 30,
        "failureThreshold": 3,
    }
    main["lifecycle"] = {"preStop": {"sleep": {"seconds": 10}}}
    spec["terminationGracePeriodSeconds"] = ENGINE_DRAIN_S
    spec["readinessGates"] = [{"conditionType": WEIGHTS_CURRENT}]
    spec["automountServiceAccountToken"] = False  # an engine never calls the Kubernetes API
    labels = {**job_labels(job, "engine", pool=pool, replica=str(replica)), **gang.labels}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata(owner, f"{pool}-{replica}", labels, gang.annotations),
        "spec": spec,
    }


def rank_env(*, trainer: str, namespace: str, rank: int, nodes: int, nproc: int) -> dict[str, str]:
    """torchrun-style rendezvous env of rank pod `rank` (Kubeflow Trainer's conventions).

    One pod per node: WORLD_SIZE/RANK count pods (torchrun rewrites them per process), NNODES,
    NODE_RANK, NPROC_PER_NODE configure torchrun, and PET_* mirror them for `torchrun` without flags.
    MASTER_ADDR is rank 0's stable DNS name through the headless Service.
    """
    master = f"{trainer}-0.{trainer}.{namespace}.svc"
    env = {
        "MASTER_ADDR": master,
        "MASTER_PORT": str(RENDEZVOUS_PORT),
        "WORLD_SIZE": str(nodes),
        "RANK": str(rank),
        "NODE_RANK": str(rank),
        "NNODES": str(nodes),
        "NPROC_PER_NODE": str(nproc),
    }
    env.update(
        {
            "PET_MASTER_ADDR": master,
            "PET_MASTER_PORT": str(RENDEZVOUS_PORT),
            "PET_NNODES": str(nodes),
            "PET_NODE_RANK": str(rank),
            "PET_NPROC_PER_NODE": str(nproc),
        }
    )
    return env


def run_dir(job: str, *, shared: bool) -> str:
    """A rank pod's LOCKSTEP_RUN_DIR: /shared/lockstep/<job> on the shared volume, else the emptyDir's
    mount (pure)."""
    return f"{SHARED_MOUNT}/lockstep/{job}" if shared else RUN_MOUNT


def rank_pod(
    owner: Owner,
    *,
    job: str,
    trainer: str,
    rank: int,
    nodes: int,
    generation: int,
    container: Container,
    placement: Placement,
    gang: Gang,
    router_url: str,
    engines_service: str,
    shared_pool: str | None = None,
    grace_seconds: int | None = None,
) -> Manifest:
    """Trainer rank pod `<trainer>-<rank>` with a stable hostname under the headless Service `<trainer>`.

    `shared_pool`: the standalone RolloutPool the job uses (rollout.poolRef): the engines' API key is
    that pool's, and the pod carries the pool-client label its engines' NetworkPolicy admits.

    The ranks take the RL steps: rank 0 serves the driver's commands on the `control` port (29600,
    `lockstep trainer --serve`) and pushes weights to every engine itself, each address of the
    headless Service LOCKSTEP_ENGINES_SERVICE (LOCKSTEP_ROUTER_URL, the load-balanced router, is for
    rollouts: a push through it would reach one engine).
    LOCKSTEP_RUN_DIR (checkpoints under trainer/) is `run_dir(job, shared)`: on the job's shared volume
    when it names one (a restarted group, whose ranks may land on other nodes, resumes from it; the
    engines read disk-delta copies from the same path), else an emptyDir that lives as long as the pod
    (a gang restart then starts from the base checkpoint).
    restartPolicy Never: a failed rank fails the whole group, which the TrainerGroup reconcile
    restarts as a gang (all ranks deleted and recreated with `generation` + 1). A rank that cannot
    start reports why into the progress ConfigMap (ServiceAccount `<job>-trainer`, patch only), so the
    job fails with the reason instead of restarting the gang. `grace_seconds` (the job's
    preemptionGraceSeconds) is the pod's terminationGracePeriodSeconds: after SIGTERM rank 0 finishes
    its command and writes the checkpoint the driver asks for within it.
    """
    nproc = max(placement.gpus, 1)
    env = {
        **_base_env(job),
        "LOCKSTEP_ROLE": "trainer",
        "LOCKSTEP_ROUTER_URL": router_url,
        "LOCKSTEP_ENGINES_SERVICE": engines_service,
        "LOCKSTEP_RUN_DIR": run_dir(job, shared=bool(container.shared_volume_claim)),
        "LOCKSTEP_PROGRESS_CONFIGMAP": progress_name(job),
        **rank_env(trainer=trainer, namespace=owner.namespace, rank=rank, nodes=nodes, nproc=nproc),
    }
    spec = _with_api_key(_pod_spec(container, placement, gang, env=env, restart="Never"), shared_pool or job)
    if not container.shared_volume_claim:
        spec["volumes"].append({"name": "run", "emptyDir": {}})
        spec["containers"][0]["volumeMounts"].append({"name": "run", "mountPath": RUN_MOUNT})
    spec["serviceAccountName"] = trainer_name(job)
    if grace_seconds is not None:
        spec["terminationGracePeriodSeconds"] = grace_seconds
    spec["hostname"] = f"{trainer}-{rank}"
    spec["subdomain"] = trainer
    spec["containers"][0]["ports"] = [
        {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT},
        {"name": "control", "containerPort": CONTROL_PORT},
        _metrics_port(),
    ]
    labels = {**job_labels(job, "trainer", trainer=trainer, rank=str(rank)), **gang.labels}
    if shared_pool:
        labels[LABEL_POOL_CLIENT] = shared_pool
    annotations = {**gang.annotations, Annotation.GANG_GENERATION.value: str(generation)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata(owner, f"{trainer}-{rank}", labels, annotations),
        "spec": spec,
    }


def driver_run_dir(job: str, *, shared: bool) -> str:
    """The driver pod's LOCKSTEP_RUN_DIR (metrics.jsonl, the mirrored pre-flight result): `driver/`
    beside the ranks' run dir on the shared volume, else the pod's emptyDir `run` (pure). Never the
    image's filesystem: the image's user 1000 cannot create /var/lib/lockstep there."""
    return f"{run_dir(job, shared=True)}/driver" if shared else RUN_MOUNT


def driver_pod(
    owner: Owner,
    *,
    job: str,
    container: Container,
    router_url: str,
    trainer: str,
    trainer_url: str,
    progress_config_map: str,
    engines_service: str,
    placement: Placement | None = None,
    shared_pool: str | None = None,
    grace_seconds: int | None = None,
) -> Manifest:
    """The driver pod: owns the RL loop and the async buffer; reports progress into one ConfigMap.
    `shared_pool`: as for rank_pod (the standalone pool's API key and pool-client label).

    It sends the RL steps to trainer rank 0 at LOCKSTEP_TRAINER_URL (the only pod the trainer's
    NetworkPolicy lets reach that port) and runs as ServiceAccount `<job>-driver`, whose Role only
    allows get/patch on that ConfigMap. `placement`: the job's node selector and tolerations (a job
    pinned to some nodes pins its driver too); it requests one CPU and no GPU.
    Its run dir is `driver_run_dir` (a writable volume).
    restartPolicy OnFailure: a crashed driver resumes from its last checkpoint. `grace_seconds` (the
    job's preemptionGraceSeconds) is its terminationGracePeriodSeconds: after SIGTERM the driver stops
    rollout and checkpoints within it.
    """
    shared = bool(container.shared_volume_claim)
    env = {
        **_base_env(job),
        "LOCKSTEP_ROLE": "driver",
        "LOCKSTEP_ROUTER_URL": router_url,
        "LOCKSTEP_TRAINER_SERVICE": trainer,
        "LOCKSTEP_TRAINER_URL": trainer_url,
        "LOCKSTEP_PROGRESS_CONFIGMAP": progress_config_map,
        "LOCKSTEP_ENGINES_SERVICE": engines_service,
        "LOCKSTEP_RUN_DIR": driver_run_dir(job, shared=shared),
    }
    place = placement or Placement()
    cpu_only = Placement(
        cpu="1",
        node_selector=place.node_selector,
        tolerations=place.tolerations,
        architectures=place.architectures,
    )
    spec = _with_api_key(
        _pod_spec(container, cpu_only, Gang(), env=env, restart="OnFailure"), shared_pool or job
    )
    if not shared:
        spec["volumes"].append({"name": "run", "emptyDir": {}})
        spec["containers"][0]["volumeMounts"].append({"name": "run", "mountPath": RUN_MOUNT})
    spec["serviceAccountName"] = driver_name(job)
    if grace_seconds is not None:
        spec["terminationGracePeriodSeconds"] = grace_seconds
    spec["containers"][0]["ports"] = [_metrics_port()]
    labels = job_labels(job, "driver")
    if shared_pool:
        labels[LABEL_POOL_CLIENT] = shared_pool
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata(owner, driver_name(job), labels),
        "spec": spec,
    }


def pod_template_hash(pod: Manifest, inputs: Mapping[str, Any] | None = None) -> str:
    """16 hex digits of sha256 over the rendered pod spec and `inputs` (canonical JSON; pure).

    Only `spec` counts: metadata carries what must not roll a pod (gang membership labels and the
    gang's total count, which follow /scale; the gang generation). `inputs` adds what the pod reads
    besides its spec, e.g. the hash of the run config the driver and the ranks load from job.yaml.
    """
    doc = {"spec": pod["spec"], "inputs": dict(inputs or {})}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def with_template_hash(pod: Manifest, inputs: Mapping[str, Any] | None = None) -> Manifest:
    """A copy of `pod` annotated with its pod_template_hash (rl.lockstep.dev/pod-template-hash)."""
    out = clone(pod)
    annotations = out["metadata"].setdefault("annotations", {})
    annotations[Annotation.POD_TEMPLATE_HASH.value] = pod_template_hash(pod, inputs)
    return out


def template_hash_of(pod: Mapping[str, Any]) -> str | None:
    """The pod-template hash a live pod was created with (None: created without one)."""
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(Annotation.POD_TEMPLATE_HASH)


def selector_labels(
    job: str, *, pool: str | None = None, trainer: str | None = None, driver: bool = False
) -> dict[str, str]:
    """The minimal labels selecting a pool's engines, a trainer group's ranks or the job's driver."""
    if driver:
        return {LABEL_JOB: job, LABEL_ROLE: "driver"}
    if pool is not None:
        return {LABEL_JOB: job, LABEL_ROLE: "engine", LABEL_POOL: pool}
    if trainer is not None:
        return {LABEL_JOB: job, LABEL_ROLE: "trainer", LABEL_TRAINER: trainer}
    return {LABEL_JOB: job}
