"""Start-up failures reach RLJob status: the driver's and a trainer rank's real processes, real apiserver.

Why: a driver or rank that cannot start (here: a checkpoint path that does not exist) must not crash
loop silently; it reports why on the progress channel and the RLJob shows Failed with the reason.
kwok pods run no process, so each test runs the process a pod would run, `lockstep driver` or
`lockstep trainer --serve`, on this machine, seeing what its pod sees: the job.yaml the operator
rendered into `<job>-config`, the env the operator sets, and the ServiceAccount files of the pod's own
account at /var/run/secrets/kubernetes.io/serviceaccount (a private mount namespace, `unshare -m`,
puts a token minted for that account there: the reporter reads the real path). The operator runs
in-process and folds the report into the status. A failed model download (the pull-model init step
of a hub checkpoint) reaches the status through the pod's init container status.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.api.progress import progress_config_map_name

from e2e.controlplane.cluster import ControlPlane

ROOT = Path(__file__).resolve().parent.parent
BAD_CHECKPOINT = "/nonexistent/models/qwen3-0.6b"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
WAIT = 60.0


@pytest.fixture(scope="module")
def operator(cluster: ControlPlane) -> Iterator[None]:
    """CRDs installed, the operator running in-process for the whole module."""
    from kopf.testing import KopfRunner

    os.environ.setdefault("LOCKSTEP_OPERATOR_RESYNC_SECONDS", "3")
    os.environ.setdefault("LOCKSTEP_OPERATOR_HA_MODE", "standalone")
    crds = sorted((ROOT / "crds").glob("rl.lockstep.dev_*.yaml"))
    for crd in crds:
        cluster.apply(crd.read_text())
    for crd in crds:
        name = yaml.safe_load(crd.read_text())["metadata"]["name"]
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    args = ["run", "--standalone", "--all-namespaces", "-m", "lockstep_operator.handlers"]
    with KopfRunner(args, timeout=60):
        yield


def _in_pod_namespace_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False)
    return probe.returncode == 0


needs_unshare = pytest.mark.skipif(
    not _in_pod_namespace_works(), reason="needs `unshare --mount` (root) to mount the ServiceAccount files"
)


def bad_job(name: str) -> dict[str, Any]:
    """tiny-local with a checkpoint that does not exist (the apiserver cannot know; the pod finds out)."""
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-local.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["model"]["checkpoint"] = BAD_CHECKPOINT
    return doc


def pod_files(cluster: ControlPlane, ns: str, job: str, account: str, into: Path) -> Path:
    """The rendered job.yaml the pod mounts, and the ServiceAccount files of `account` (token, ca.crt,
    namespace) in `into/sa`; returns the job.yaml path."""
    rendered = cluster.wait_for(
        lambda: (
            cluster.kubectl(
                "get",
                "configmap",
                f"{job}-config",
                "-n",
                ns,
                "-o",
                "jsonpath={.data.job\\.yaml}",
                check=False,
            ).stdout
        ),
        timeout=WAIT,
        what=f"{job}-config rendered by the operator",
    )
    job_yaml = into / "job.yaml"
    job_yaml.write_text(rendered)
    cluster.wait_for(
        lambda: cluster.kubectl("get", "serviceaccount", account, "-n", ns, check=False).returncode == 0,
        timeout=WAIT,
        what=f"ServiceAccount {account}",
    )
    sa = into / "sa"
    sa.mkdir()
    token = cluster.kubectl("create", "token", account, "-n", ns, "--duration=10m").stdout.strip()
    (sa / "token").write_text(token)
    (sa / "namespace").write_text(ns)
    shutil.copy(cluster.ca_file, sa / "ca.crt")
    return job_yaml


def run_as_pod(
    cluster: ControlPlane, sa: Path, argv: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """`python -m lockstep ARGV` with `sa` mounted at the pod's ServiceAccount path (private mount
    namespace) and the apiserver as the pod's in-cluster service."""
    port = cluster.api_url.rsplit(":", 1)[1]
    script = (
        "set -e; mount -t tmpfs tmpfs /run; mkdir -p " + SA_DIR + "; "
        f"cp {shlex.quote(str(sa))}/* {SA_DIR}/; "
        f"exec {shlex.quote(sys.executable)} -m lockstep " + " ".join(shlex.quote(a) for a in argv)
    )
    full_env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'runtime'}{os.pathsep}{ROOT / 'operator'}",
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": port,
        **env,
    }
    return subprocess.run(
        ["unshare", "--mount", "sh", "-c", script],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def failed_condition(cluster: ControlPlane, ns: str, job: str) -> dict[str, Any]:
    """Wait for phase Failed; the Failed condition."""

    def check() -> dict[str, Any] | None:
        status = cluster.get("rljob", job, "-n", ns).get("status") or {}
        if status.get("phase") != "Failed":
            return None
        found: dict[str, Any] = next(c for c in status["conditions"] if c["type"] == "Failed")
        return found

    got = cluster.wait_for(check, timeout=WAIT, what=f"rljob {job} Failed")
    assert got is not None
    return got


@needs_unshare
def test_a_driver_with_a_bad_checkpoint_fails_the_job_with_the_reason(
    cluster: ControlPlane, operator: None, namespace: str, tmp_path: Path
) -> None:
    job = "bad-ckpt-driver"
    cluster.apply(bad_job(job), namespace=namespace)
    job_yaml = pod_files(cluster, namespace, job, f"{job}-driver", tmp_path)
    env = {"LOCKSTEP_PROGRESS_CONFIGMAP": progress_config_map_name(job), "LOCKSTEP_JOB": job}
    argv = ["driver", "--config", str(job_yaml), "--run-dir", str(tmp_path / "run")]
    proc = run_as_pod(cluster, tmp_path / "sa", [*argv, "--engine-url", "http://127.0.0.1:9"], env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert BAD_CHECKPOINT in proc.stderr
    failed = failed_condition(cluster, namespace, job)
    assert failed["status"] == "True" and failed["reason"] == "DriverStartFailed", failed
    assert failed["message"].startswith("driver could not start: ") and BAD_CHECKPOINT in failed["message"]


@needs_unshare
def test_a_trainer_rank_with_a_bad_checkpoint_fails_the_job_with_the_reason(
    cluster: ControlPlane, operator: None, namespace: str, tmp_path: Path
) -> None:
    job = "bad-ckpt-rank"
    cluster.apply(bad_job(job), namespace=namespace)
    job_yaml = pod_files(cluster, namespace, job, f"{job}-trainer", tmp_path)
    env = {
        "LOCKSTEP_PROGRESS_CONFIGMAP": progress_config_map_name(job),
        "LOCKSTEP_ROLE": "trainer",
        "RANK": "0",
    }
    argv = ["trainer", "--config", str(job_yaml), "--serve", "--out", str(tmp_path / "out")]
    proc = run_as_pod(cluster, tmp_path / "sa", [*argv, "--engine-url", "http://127.0.0.1:9"], env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    failed = failed_condition(cluster, namespace, job)
    assert failed["status"] == "True" and failed["reason"] == "TrainerStartFailed", failed
    assert (
        failed["message"].startswith("trainer rank 0 could not start: ")
        and BAD_CHECKPOINT in failed["message"]
    )
    data = cluster.get("configmap", progress_config_map_name(job), "-n", namespace)["data"]
    assert list(data) == ["rank-0.json"]  # the rank's own key; the driver's document is untouched


def test_a_failed_model_download_fails_the_job_with_the_step_message(
    cluster: ControlPlane, operator: None, namespace: str
) -> None:
    """A hub checkpoint: the driver pod carries the pull-model init step; when the kubelet reports it
    exited 2 (kwok runs no process: the test writes that pod status, as a kubelet would), the job
    fails with ModelPullFailed and pull-model's message instead of the driver restarting its init."""
    job = "bad-hub-ref"
    manifest = bad_job(job)
    manifest["spec"]["model"]["checkpoint"] = "no-such-org/no-such-model"
    cluster.apply(manifest, namespace=namespace)
    driver = f"{job}-driver"

    def running_driver() -> dict[str, Any] | None:
        got = cluster.kubectl("get", "pod", driver, "-n", namespace, "-o", "json", check=False)
        pod: dict[str, Any] = json.loads(got.stdout) if got.returncode == 0 else {}
        return pod if (pod.get("status") or {}).get("phase") == "Running" else None

    pod = cluster.wait_for(running_driver, timeout=WAIT, what=f"pod {driver} Running")
    assert pod is not None
    [init] = pod["spec"]["initContainers"]
    assert init["command"][:3] == ["lockstep", "pull-model", "no-such-org/no-such-model"]
    message = "error: model no-such-org/no-such-model: repository not found on https://huggingface.co"
    # As the kubelet reports a failed init step (kwok already marked this one Completed, and a
    # terminated container may only be reported terminated again: the exit code and message change).
    ended = {"exitCode": 2, "reason": "Error", "message": message, "startedAt": "2026-12-03T00:00:00Z",
             "finishedAt": "2026-12-03T00:00:01Z"}  # fmt: skip
    status = {
        "status": {
            "initContainerStatuses": [
                {"name": "pull-model", "image": init["image"], "imageID": "", "ready": False,
                 "restartCount": 0, "state": {"terminated": ended}}
            ]
        }
    }  # fmt: skip
    cluster.kubectl(
        "patch",
        "pod",
        driver,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )
    failed = failed_condition(cluster, namespace, job)
    assert failed["reason"] == "ModelPullFailed", failed
    assert failed["message"] == f"driver pod: pull-model exited 2: {message}"


def test_a_failed_serving_conversion_fails_the_job_and_keeps_the_engine_pod(
    cluster: ControlPlane, operator: None, namespace: str, tmp_path: Path
) -> None:
    """FP8 serving: the engine pod's convert-model init step, run here exactly as rendered (its
    checkpoint does not exist), exits 2; reported as the kubelet would (kwok runs no process), the
    job fails with ServingCheckpointFailed and that message, and the pool keeps the pod (a new one
    would fail the same way) instead of replacing it."""
    job = "bad-serving"
    manifest = bad_job(job)
    manifest["spec"]["rollout"]["precision"] = "fp8"
    cluster.apply(manifest, namespace=namespace)
    engine = f"{job}-rollout-0"

    def running_engine() -> dict[str, Any] | None:
        got = cluster.kubectl("get", "pod", engine, "-n", namespace, "-o", "json", check=False)
        pod: dict[str, Any] = json.loads(got.stdout) if got.returncode == 0 else {}
        return pod if (pod.get("status") or {}).get("phase") == "Running" else None

    pod = cluster.wait_for(running_engine, timeout=WAIT, what=f"pod {engine} Running")
    assert pod is not None
    [convert] = pod["spec"]["initContainers"]
    assert convert["command"][:3] == ["lockstep", "convert-model", BAD_CHECKPOINT]
    argv = [*convert["command"][1:]]
    argv[argv.index("--dest") + 1] = str(tmp_path / "serving")  # the step itself, on this machine's disk
    proc = subprocess.run(
        [sys.executable, "-m", "lockstep", *argv], capture_output=True, text=True, check=False, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    message = proc.stderr.strip().splitlines()[-1]
    ended = {"exitCode": 2, "reason": "Error", "message": message, "startedAt": "2026-12-03T00:00:00Z",
             "finishedAt": "2026-12-03T00:00:01Z"}  # fmt: skip
    status = {
        "status": {
            "phase": "Failed",  # restartPolicy Never: a failed init step fails the pod
            "initContainerStatuses": [
                {"name": "convert-model", "image": convert["image"], "imageID": "", "ready": False,
                 "restartCount": 0, "state": {"terminated": ended}}
            ],
        }
    }  # fmt: skip
    uid = pod["metadata"]["uid"]
    cluster.kubectl(
        "patch", "pod", engine, "-n", namespace, "--subresource=status", "--type=merge", "-p", json.dumps(status)
    )  # fmt: skip
    failed = failed_condition(cluster, namespace, job)
    assert failed["reason"] == "ServingCheckpointFailed", failed
    assert failed["message"] == f"engine pod {engine}: convert-model exited 2: {message}"
    assert "not an HF-layout checkpoint" in message
    kept = json.loads(
        cluster.kubectl("get", "pod", engine, "-n", namespace, "-o", "json", check=False).stdout or "{}"
    )
    assert kept.get("metadata", {}).get("uid") in (
        uid,
        None,
    )  # never replaced by a new pod (the job may tear it down)
