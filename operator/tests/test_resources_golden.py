"""Golden tests of the child manifests: what the operator applies for the examples, byte for byte.

Regenerate after an intended change with `LOCKSTEP_UPDATE_GOLDEN=1 pytest operator/tests` and review
the diff of operator/tests/golden/.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.api.rljob import Autoscaling, RLJob
from lockstep.api.rolloutpool import RolloutPoolSpec
from lockstep.api.trainergroup import TrainerGroupSpec
from lockstep_operator.k8s.client import manifest_path
from lockstep_operator.resources import config, podgroups
from lockstep_operator.resources.children import child_manifests
from lockstep_operator.resources.common import Owner
from lockstep_operator.resources.driver import driver_manifest
from lockstep_operator.resources.engines import engine_manifest
from lockstep_operator.resources.network import (
    driver_network_policy,
    engine_network_policy,
    trainer_network_policy,
)
from lockstep_operator.resources.podgroups import gang_min_member
from lockstep_operator.resources.pods import rank_env, selector_labels
from lockstep_operator.resources.ranks import rank_manifest
from lockstep_operator.resources.secrets import api_key_secret, new_api_key
from lockstep_operator.resources.services import engines_service, headless_service

GOLDEN = Path(__file__).parent / "golden"
IMAGE = "registry.example/lockstep-runtime:test"


def load(name: str) -> RLJob:
    return RLJob.model_validate(
        yaml.safe_load((Path(__file__).parent / "fixtures" / f"{name}.yaml").read_text())
    )


def owner(kind: str, name: str) -> Owner:
    return Owner(
        api_version="rl.lockstep.dev/v1alpha1",
        kind=kind,
        name=name,
        uid=f"uid-{name}",
        namespace="team-a",
        labels={"team": "rl"},
    )


def check(name: str, value: Any) -> None:
    text = yaml.safe_dump(value, sort_keys=True)
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("LOCKSTEP_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}: run with LOCKSTEP_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} differs from {path}"


@pytest.mark.parametrize("example", ["h100", "glm5-gb300", "tiny-local"])
def test_job_children(example: str) -> None:
    job = load(example)
    name = job.metadata.name
    own = owner("RLJob", name)
    clique = "uuid.1" if example == "glm5-gb300" else ""
    pool, trainer, channel = child_manifests(
        own, job.spec, suspended=False, stopped="", clique=clique, avoid_clique=clique
    )
    pool_spec = RolloutPoolSpec.model_validate({**pool["spec"], "replicas": job.spec.rollout.replicas})
    trainer_spec = TrainerGroupSpec.model_validate(trainer["spec"])
    engine0 = engine_manifest(
        owner("RolloutPool", f"{name}-rollout"),
        pool_spec,
        0,
        gang_min=gang_min_member(job.spec),
        image=IMAGE,
        avoid_clique=clique,
    )
    rank0 = rank_manifest(
        owner("TrainerGroup", f"{name}-trainer"),
        trainer_spec,
        0,
        generation=0,
        gang_min=gang_min_member(job.spec),
        clique=clique,
        image=IMAGE,
        config_hash=trainer["metadata"]["annotations"]["rl.lockstep.dev/config-hash"],
    )
    check(
        f"{example}-children",
        {
            "pool": _own(pool),
            "trainer": _own(trainer),
            "channel": _own(channel),
            "engine0": engine0,
            "rank0": rank0,
            "driver": driver_manifest(own, job.spec, image=IMAGE),
            "trainerService": headless_service(
                owner("TrainerGroup", f"{name}-trainer"),
                job=name,
                name=f"{name}-trainer",
                selector=selector_labels(name, trainer=f"{name}-trainer"),
            ),
            "enginesService": engines_service(
                owner("RolloutPool", f"{name}-rollout"),
                job=name,
                name=f"{name}-rollout-engines",
                selector=selector_labels(name, pool=f"{name}-rollout"),
            ),
            "trainerNetworkPolicy": trainer_network_policy(
                owner("TrainerGroup", f"{name}-trainer"),
                job=name,
                trainer=f"{name}-trainer",
                pool=f"{name}-rollout",
            ),
            "engineNetworkPolicy": engine_network_policy(
                owner("RolloutPool", f"{name}-rollout"),
                job=name,
                pool=f"{name}-rollout",
                trainer=f"{name}-trainer",
            ),
            "driverNetworkPolicy": driver_network_policy(own, job=name),
            "apiKeySecret": api_key_secret(own, job=name, key="<random>"),
        },
    )
    # The sections copied from the job are exactly the job's (kept out of the golden file, so new
    # API defaults do not churn it).
    wire = job.spec.wire()
    assert trainer["spec"]["trainer"] == wire["trainer"] and trainer["spec"]["model"] == wire["model"]
    assert (
        pool["spec"]["placement"] == wire["placement"] and channel["spec"]["weightSync"] == wire["weightSync"]
    )


COPIED = ("model", "trainer", "engine", "placement", "weightSync")


def _own(child: dict[str, Any]) -> dict[str, Any]:
    """A child kind without the spec sections copied verbatim from the job."""
    return {**child, "spec": {k: v for k, v in child["spec"].items() if k not in COPIED}}


def test_driver_config_and_rbac() -> None:
    own = owner("RLJob", "j")
    check("driver-config-rbac", {
        "config": config.runtime_config_map(own, job="j", rendered={"spec": {"a": 1}}),
        "progress": config.progress_config_map(own, job="j"),
        "rbac": config.driver_rbac(own, job="j"),
        "trainer-rbac": config.trainer_rbac(own, job="j"),
    })  # fmt: skip


def test_pod_groups_per_scheduler() -> None:
    own = owner("RLJob", "j")
    groups = {s: podgroups.pod_group(own, job="j", scheduler=s, min_member=16, queue="rl")
              for s in ("none", "volcano", "kueue", "scheduler-plugins")}  # fmt: skip
    keys = {
        f"{s}-{m}": podgroups.member_keys(job="j", scheduler=s, min_member=16, queue="rl", member=m)
        for s in ("none", "volcano", "kueue", "scheduler-plugins")
        for m in (True, False)
    }
    as_dict = {k: {"scheduler": g.scheduler_name, "labels": dict(g.labels), "annotations": dict(g.annotations)}
               for k, g in keys.items()}  # fmt: skip
    check("podgroups", {"groups": groups, "keys": as_dict})
    assert groups["volcano"] is not None and groups["volcano"]["spec"]["minMember"] == 16
    assert groups["none"] is None and groups["kueue"] is None


def test_gang_counts_all_ranks_and_min_replicas() -> None:
    spec = load("glm5-gb300").spec
    assert gang_min_member(spec) == spec.trainer.nodes + spec.rollout.replicas
    scaled = spec.model_copy(update={"rollout": spec.rollout.model_copy(
        update={"autoscaling": Autoscaling(min_replicas=2, max_replicas=8)})})  # fmt: skip
    assert gang_min_member(scaled) == spec.trainer.nodes + 2


def test_rank_env_is_torchrun_style() -> None:
    env = rank_env(trainer="j-trainer", namespace="ns", rank=3, nodes=4, nproc=8)
    assert env["MASTER_ADDR"] == "j-trainer-0.j-trainer.ns.svc" and env["MASTER_PORT"] == "29500"
    assert (env["WORLD_SIZE"], env["RANK"], env["NODE_RANK"], env["NPROC_PER_NODE"]) == ("4", "3", "3", "8")
    assert (env["PET_NNODES"], env["PET_NODE_RANK"], env["PET_NPROC_PER_NODE"]) == ("4", "3", "8")


def test_trainer_control_port_is_reachable_from_the_driver_only() -> None:
    policy = trainer_network_policy(
        owner("TrainerGroup", "j-trainer"), job="j", trainer="j-trainer", pool="j-rollout"
    )
    rules = policy["spec"]["ingress"]
    to_control = [
        r for r in rules if any(p["port"] <= 29600 <= p.get("endPort", p["port"]) for p in r["ports"])
    ]
    assert [r["from"] for r in to_control] == [
        [{"podSelector": {"matchLabels": {"rl.lockstep.dev/job": "j", "rl.lockstep.dev/role": "driver"}}}]
    ]
    peers = next(r for r in rules if r not in to_control)
    assert {p["podSelector"]["matchLabels"]["rl.lockstep.dev/role"] for p in peers["from"]} == {
        "trainer",
        "engine",
    }
    covered = sum(p["endPort"] - p["port"] + 1 for p in peers["ports"])
    assert covered == 65535 - 1  # every TCP port but the control port (NCCL picks ephemeral ports)


def test_rank_run_dir_is_on_the_shared_volume_when_the_job_names_one() -> None:
    job = load("h100")
    name = job.metadata.name
    _, trainer, _ = child_manifests(
        owner("RLJob", name), job.spec, suspended=False, stopped="", clique="", avoid_clique=""
    )
    trainer_spec = TrainerGroupSpec.model_validate(trainer["spec"])

    def rank0(shared: str | None) -> dict[str, Any]:
        return rank_manifest(
            owner("TrainerGroup", f"{name}-trainer"), trainer_spec, 0, generation=0, gang_min=1,
            clique=None, image=IMAGE, shared_volume=shared,
        )  # fmt: skip

    for pod, run_dir, volume in [
        (rank0("rl-shared"), f"/shared/lockstep/{name}", {"name": "shared", "persistentVolumeClaim": {"claimName": "rl-shared"}}),
        (rank0(None), "/var/lib/lockstep/run", {"name": "run", "emptyDir": {}}),
    ]:  # fmt: skip
        main = pod["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in main["env"]}
        assert env["LOCKSTEP_RUN_DIR"] == run_dir
        assert volume in pod["spec"]["volumes"]
        mounted = [m["mountPath"] for m in main["volumeMounts"] if m["name"] == volume["name"]]
        assert any(run_dir.startswith(m) for m in mounted)  # the run dir is on a mounted volume
        own = sorted(v["name"] for v in pod["spec"]["volumes"] if v["name"] != "model")  # hub model aside
        assert own == sorted(["config", "dshm", volume["name"]])  # exactly one of shared / run


def test_p2p_rank_pods_get_rdma_ipc_lock_and_shm() -> None:
    """A p2p job's ranks request one RDMA device each and may pin memory; others get neither."""
    job = load("h100")
    _, trainer, _ = child_manifests(owner("RLJob", job.metadata.name), job.spec, suspended=False, stopped="")
    spec = TrainerGroupSpec.model_validate(trainer["spec"])

    def rank0(rdma: str | None) -> dict[str, Any]:
        pod = rank_manifest(
            owner("TrainerGroup", "t"),
            spec,
            0,
            generation=0,
            gang_min=1,
            clique=None,
            image=IMAGE,
            p2p_rdma=rdma,
        )
        main: dict[str, Any] = pod["spec"]["containers"][0]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in main["volumeMounts"]
        return main

    p2p = rank0("rdma/ib")
    assert p2p["resources"]["limits"]["rdma/ib"] == p2p["resources"]["requests"]["rdma/ib"] == "1"
    assert p2p["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    plain = rank0(None)
    assert (
        "rdma/ib" not in plain["resources"]["limits"]
        and "add" not in plain["securityContext"]["capabilities"]
    )


@pytest.mark.parametrize(("example", "sglang"), [("h100", True), ("tiny-local", False)])
def test_engine_pods_run_as_sglangs_docs_run_them(example: str, sglang: bool) -> None:
    """A sized /dev/shm, startup on /health, readiness on /health_generate (SGLang lets probes in without
    the API key), graceful drain; both engines read the job's API key from its Secret, SGLang through
    the config file its start step writes (never --api-key: SGLang logs its arguments)."""
    job = load(example)
    pool, _, _ = child_manifests(owner("RLJob", job.metadata.name), job.spec, suspended=False, stopped="")
    spec = RolloutPoolSpec.model_validate(pool["spec"])
    pod = engine_manifest(owner("RolloutPool", "p"), spec, 0, gang_min=1, image=IMAGE)
    main = pod["spec"]["containers"][0]
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {
        "medium": "Memory",
        "sizeLimit": "32Gi" if spec.engine.gpus_per_engine else "1Gi",
    }
    assert {"name": "dshm", "mountPath": "/dev/shm"} in main["volumeMounts"]
    assert main["startupProbe"]["httpGet"]["path"] == "/health"
    assert main["readinessProbe"]["httpGet"]["path"] == "/health_generate"
    assert main["lifecycle"]["preStop"] == {"sleep": {"seconds": 10}}
    assert pod["spec"]["terminationGracePeriodSeconds"] == 600
    secret = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in main["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert secret == {"LOCKSTEP_API_KEY": {"name": f"{job.metadata.name}-api-key", "key": "api-key"}}
    assert "--api-key" not in main["command"] and "$(LOCKSTEP_API_KEY)" not in str(main)
    starts = main["command"][:4] == ["python3", "-m", "lockstep.observability.sglang_start", "--"]
    assert starts is sglang


def test_api_keys_are_random_and_only_referenced_by_pods() -> None:
    keys = {new_api_key() for _ in range(64)}
    assert len(keys) == 64 and all(len(k) >= 43 for k in keys)
    job = load("h100")
    own = owner("RLJob", job.metadata.name)
    secret = api_key_secret(own, job=job.metadata.name, key="s3cret")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == own.uid  # deleted with the job
    assert manifest_path(secret, named=False) == f"/api/v1/namespaces/{own.namespace}/secrets"
    driver = driver_manifest(own, job.spec, image=IMAGE)
    env = {e["name"]: e for e in driver["spec"]["containers"][0]["env"]}
    assert env["LOCKSTEP_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{job.metadata.name}-api-key",
        "key": "api-key",
    }
    assert "s3cret" not in yaml.safe_dump(driver)


def test_the_driver_follows_the_job_placement_and_writes_to_a_volume() -> None:
    """Found on the real node: a driver without the job's node selector and tolerations never reached
    the (tainted) nodes the job was pinned to, and its run dir /var/lib/lockstep/run was not writable
    by the image's user 1000 (no volume there)."""
    ROOT = Path(__file__).resolve().parents[2]
    job = RLJob.model_validate(yaml.safe_load((ROOT / "examples" / "tiny-cluster.yaml").read_text()))
    own = owner("RLJob", job.metadata.name)
    spec = driver_manifest(own, job.spec, image=IMAGE)["spec"]
    assert spec["nodeSelector"] == {"lockstep.dev/node": "real"}
    assert spec["tolerations"] == [{"key": "lockstep.dev/node", "operator": "Exists", "effect": "NoSchedule"}]
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["LOCKSTEP_RUN_DIR"] == "/shared/lockstep/tiny-cluster/driver"
    assert {"name": "shared", "persistentVolumeClaim": {"claimName": "tiny-cluster-shared"}} in spec[
        "volumes"
    ]
    assert spec["containers"][0]["resources"] == {"requests": {"cpu": "1"}}  # never a GPU
    plain = driver_manifest(own, load("tiny-local").spec, image=IMAGE)["spec"]
    mounts = {m["mountPath"]: m["name"] for m in plain["containers"][0]["volumeMounts"]}
    assert mounts["/var/lib/lockstep/run"] == "run"
    assert {"name": "run", "emptyDir": {}} in plain["volumes"]
    assert "nodeSelector" not in plain and "tolerations" not in plain


def test_sandbox_template_warm_pool_and_claim_role() -> None:
    """A job with spec.agent.sandbox owns a SandboxTemplate (PSS restricted, no token, requests ==
    limits, deny-all network policy) and a warm pool sized from the rollout concurrency; its driver may
    claim and exec, and is told the pool's name."""
    from lockstep_operator.resources.sandbox import sandbox_manifests

    job = load("tiny-sandbox")
    own = owner("RLJob", "tiny-sandbox")
    manifests = sandbox_manifests(own, job.spec)
    driver_env = driver_manifest(own, job.spec, image=IMAGE)["spec"]["containers"][0]["env"]
    check("tiny-sandbox-sandbox", {
        "manifests": manifests,
        "driver-env": [e for e in driver_env if e["name"].startswith(("LOCKSTEP_SANDBOX", "LOCKSTEP_POD_UID"))],
    })  # fmt: skip
    template, pool = manifests[0], manifests[1]
    pod = template["spec"]["podTemplate"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"]
    (box,) = pod["containers"]
    assert box["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert box["resources"]["requests"] == box["resources"]["limits"]
    assert template["spec"]["networkPolicy"] == {"ingress": [], "egress": []}
    assert pool["spec"]["replicas"] == 64  # 8 groups x 8 episodes, within maxInFlight 64
    assert sandbox_manifests(own, load("tiny-local").spec) == []
