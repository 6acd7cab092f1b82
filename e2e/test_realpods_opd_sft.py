"""SFT and on-policy-distillation jobs on real pods, from `kubectl apply` to Succeeded (docs/distillation.md).

On the local cluster's real node, with the operator running as in the other real-pod tests:
- an SFT job (spec.recipe sft, examples/tiny-sft.yaml shortened): a trainer rank pod and the driver only;
  no RolloutPool, no WeightChannel and no engine pod exist at any time; the Step column reaches the
  schedule's steps and the job Succeeded;
- an OPD job with a teacher of each kind the operator serves (examples/local-cluster/opd-teacher-pool.yaml,
  shortened, plus a checkpoint teacher): its own teacher pool (`<job>-teacher-self`, role teacher, never
  updated) and a standalone RolloutPool of role teacher (algorithm.opd.teachers[].poolRef) that scores the
  task's samples. Applied before that pool, the job waits Pending (Admitted False, PoolNotFound, naming
  the pool to create) with no pod; then the driver finds both teachers through LOCKSTEP_TEACHER_URLS,
  opens the standalone pool with that pool's own key through its NetworkPolicy, checks both tokenizers,
  and the job Succeeded; the standalone pool's engine itself (GET /engine_stats) scored prompt tokens and
  still holds its first weight version, and outlives the job; a LoRA job whose rollout.poolRef names
  the teacher pool fails at once. One job for both kinds: one cluster job's wall time in `make test`.
Short jobs: the wall time is `make test`'s.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.controlplane.cluster import ControlPlane
from e2e.operator_runner import Operator
from e2e.test_realpods import diagnose, finished, job_status, operator, pods, runtime_image, wait

__all__ = ["operator", "runtime_image"]  # the fixtures, shared with the example's e2e test

ROOT = Path(__file__).resolve().parent.parent
REAL_NODE = {
    "nodeSelector": {"lockstep.dev/node": "real"},
    "tolerations": [{"key": "lockstep.dev/node", "operator": "Exists", "effect": "NoSchedule"}],
}

pytestmark = pytest.mark.timeout(3600)


def _sft_job() -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-sft.yaml").read_text())
    job["spec"]["model"]["checkpoint"] = "builtin:tiny"
    job["spec"]["algorithm"]["batchSize"] = 8
    job["spec"]["schedule"] = {"steps": 4, "saveInterval": 2}
    job["spec"]["placement"] = REAL_NODE
    return job


def test_an_sft_job_runs_without_any_engine(
    real_cluster: ControlPlane, real_namespace: str, operator: Operator
) -> None:
    cluster, ns = real_cluster, real_namespace
    cluster.apply(_sft_job(), namespace=ns)
    engines_seen: set[str] = set()

    def done() -> bool:
        engines_seen.update(p["metadata"]["name"] for p in pods(cluster, ns, "tiny-sft", "engine"))
        st = cluster.get("rljob", "tiny-sft", "-n", ns).get("status") or {}
        return st.get("phase") in ("Succeeded", "Failed")

    wait(cluster, ns, done, "the SFT job finished")
    st = finished(cluster, ns, "tiny-sft")
    assert st["phase"] == "Succeeded", diagnose(cluster, ns)
    assert st["step"] == 4
    assert not engines_seen, engines_seen
    assert cluster.get("rolloutpools", "-n", ns)["items"] == []
    assert cluster.get("weightchannels", "-n", ns)["items"] == []
    conditions = {c["type"]: c for c in st["conditions"]}
    assert conditions["WeightChannelReady"]["reason"] == "NoEngines"


def _engine_stats(cluster: ControlPlane, ns: str, pool: str) -> dict[str, Any] | None:
    """GET /engine_stats of the pool's one running engine, asked inside its pod (it binds the pod IP);
    None while none runs or it does not answer yet."""
    running = [p for p in pods(cluster, ns, pool, "engine") if p["status"].get("phase") == "Running"]
    if len(running) != 1:
        return None
    code = (
        "import json, os, urllib.request; "
        "print(urllib.request.urlopen(f\"http://{os.environ['POD_IP']}:30000/engine_stats\").read().decode())"
    )
    name = running[0]["metadata"]["name"]
    out = cluster.kubectl("exec", "-n", ns, name, "--", "python3", "-c", code, check=False)
    if out.returncode != 0:
        return None
    stats: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return stats


def test_an_opd_job_reads_its_own_teacher_pool_and_a_standalone_one_it_never_updates(
    real_cluster: ControlPlane, real_namespace: str, operator: Operator
) -> None:
    cluster, ns = real_cluster, real_namespace
    pool, job = yaml.safe_load_all(
        (ROOT / "examples" / "local-cluster" / "opd-teacher-pool.yaml").read_text()
    )
    job["spec"]["algorithm"].update(batchSize=2, samplesPerPrompt=4)
    # two teachers, one of each kind the operator serves: the standalone pool scores the task's samples
    # (label reverse), the job's own teacher pool is the default
    job["spec"]["algorithm"]["opd"] = {
        "teachers": [
            {"name": "tutor", "poolRef": {"name": "tutor"}, "labels": ["reverse"]},
            {"name": "self", "checkpoint": "builtin:tiny"},
        ],
        "defaultTeacher": "self",
    }
    job["spec"]["weightSync"]["checkWeightUpdateEqual"] = False
    job["spec"]["schedule"] = {"mode": "sync", "steps": 3}
    lora = copy.deepcopy(job)  # samples on the teacher pool: it would update it
    lora["metadata"]["name"] = "lora-on-tutor"
    lora["spec"]["algorithm"].pop("opd")
    lora["spec"]["model"]["lora"] = {"rank": 4}
    lora["spec"]["rollout"] = {"poolRef": {"name": "tutor"}, "sampling": {"maxNewTokens": 6}}
    cluster.apply(job, namespace=ns)  # before its teacher pool: it waits, saying what to create

    def admitted() -> dict[str, Any] | None:
        conditions = {c["type"]: c for c in job_status(cluster, ns, "opd-from-pool").get("conditions") or []}
        return conditions.get("Admitted")

    waiting = wait(cluster, ns, admitted, "the job says why it waits")
    assert waiting["reason"] == "PoolNotFound", waiting
    assert "teachers[tutor].poolRef: RolloutPool tutor does not exist" in waiting["message"], waiting
    assert job_status(cluster, ns, "opd-from-pool")["phase"] == "Pending"
    assert pods(cluster, ns, "opd-from-pool") == []
    cluster.apply(pool, namespace=ns)
    cluster.apply(lora, namespace=ns)
    refused = finished(cluster, ns, "lora-on-tutor")
    assert refused["phase"] == "Failed", refused
    failed = {c["type"]: c for c in refused["conditions"]}["Failed"]
    assert "RolloutPool tutor is a teacher pool (spec.role teacher)" in failed["message"], failed
    assert pods(cluster, ns, "lora-on-tutor", "driver") == []
    before = wait(
        cluster, ns, lambda: _engine_stats(cluster, ns, "tutor"), "the teacher pool's engine serves"
    )

    def checked() -> bool:
        out = cluster.kubectl("logs", "-n", ns, "opd-from-pool-driver", check=False).stdout
        return all(f"teacher {t}: the same string for each of" in out for t in ("tutor", "self"))

    wait(cluster, ns, checked, "the driver checked both teachers' tokenizers")
    own = cluster.get("rolloutpool", "opd-from-pool-teacher-self", "-n", ns)["spec"]
    assert (
        own["role"] == "teacher"
        and own["job"] == "opd-from-pool"
        and own["model"]["checkpoint"] == "builtin:tiny"
    )
    st = finished(cluster, ns, "opd-from-pool")
    assert st["phase"] == "Succeeded", diagnose(cluster, ns)
    assert st["step"] == 3
    after = _engine_stats(cluster, ns, "tutor")
    assert after is not None, diagnose(cluster, ns)
    # the kubelet's /health_generate probe adds one prompt and one generated token; a scoring request
    # its row's tokens and none generated: so what is left is the scored rows, 3 steps x 2 x 4 of them
    # (chat-templated prompt + response: more than 8 tokens each)
    probes = after["generated_tokens"] - before["generated_tokens"]
    scored = after["prompt_tokens"] - before["prompt_tokens"] - probes
    assert scored >= 3 * 2 * 4 * 8, (scored, before, after)
    assert after["weight_version"] == before["weight_version"]  # nor was updated
    assert cluster.get("rolloutpool", "tutor", "-n", ns)["spec"].get("job") is None
    assert [p["status"]["phase"] for p in pods(cluster, ns, "tutor", "engine")] == ["Running"]
