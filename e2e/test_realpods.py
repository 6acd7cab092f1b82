"""The example RLJob on real pods: `kubectl apply` of examples/tiny-cluster.yaml trains to completion on
the local cluster's real node, watched through `kubectl get rljobs`. (docs/controlplane.md.)

Why: kwok pods run no process, so the other e2e tests play the driver. Here nothing is played: the
operator runs in the cluster from its image, installed by the Helm chart as users install it, renders
the pods, and the real node runs them from the runtime image built here (node/runtime_image.py): `lockstep engine`, two trainer ranks under torchrun
rendezvousing over the headless Service, the driver reporting progress with its ServiceAccount token;
run dir and checkpoints sit on a hostPath-backed ReadWriteMany PersistentVolume. Part of `make test`
where the machine can run containers (else skipped with one line: node/probe.py).

Wall time is what `make test` pays, so one run of the example carries every mid-run scenario in turn
(gang restart, engine kill, scale up and down, operator restart) and the two that end a job early
(bad checkpoint, delete) are short jobs of their own. On a failure the assertion message carries every
pod's status and the tail of its logs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.controlplane.cluster import ControlPlane
from e2e.controlplane.realnode import REAL_NODE_LABEL, REAL_NODE_VALUE
from e2e.operator_runner import SYSTEM_NS, InClusterOperator

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-cluster.yaml"
JOB_LABEL = "rl.lockstep.dev/job"
PHASES = ("Pending", "Provisioning", "Preflight", "Running", "Succeeded")
RUN_TIMEOUT = 1500.0
"""Seconds a whole run may take on a loaded 2-core machine (it takes a few minutes)."""

pytestmark = pytest.mark.timeout(3600)  # cold: the runtime image (5 GiB) is built and imported first


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def runtime_image(real_cluster: ControlPlane) -> str:
    assert real_cluster.node is not None
    return real_cluster.node.runtime_image()


@pytest.fixture(scope="module")
def operator(real_cluster: ControlPlane, runtime_image: str) -> Iterator[InClusterOperator]:
    """The operator as users run it: `helm install` of charts/lockstep (CRDs, RBAC, the Deployment) with
    its default images, which the real node holds under their release references (the operator's
    and the runtime's, built here by `make images`' recipe). One replica (the 2 cores are shared),
    resync every 5 s; uninstalled at the end, so the next module's operator is the only one."""
    assert real_cluster.node is not None
    real_cluster.node.operator_image()  # built (if its inputs changed) and imported
    values = {
        "replicas": 1,
        "extraEnv": {"LOCKSTEP_OPERATOR_RESYNC_SECONDS": "5"},
        # The real node has 2 CPUs for the job's pods too (the chart's 300m is sized for 200 jobs).
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
        # The real node is tainted (kwok nodes take what does not tolerate it): placed as the example's pods.
        "nodeSelector": {REAL_NODE_LABEL: REAL_NODE_VALUE},
        "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
    }
    op = InClusterOperator(real_cluster, values)
    op.install()
    try:
        yield op
    finally:
        op.uninstall()


def shared_volume(cluster: ControlPlane, ns: str, claim: str) -> Path:
    """A hostPath PersistentVolume (ReadWriteMany) bound to claim `claim` in `ns`; its host directory
    (writable by the pods' user 1000: hostPath volumes are not chowned to the fsGroup)."""
    assert cluster.work_dir is not None
    host = cluster.work_dir / f"shared-{ns}"
    host.mkdir(parents=True, exist_ok=True)
    host.chmod(0o1777)
    pv = {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-{claim}"},
        "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Retain", "claimRef": {"namespace": ns, "name": claim},
                 "hostPath": {"path": str(host), "type": "Directory"}},
    }  # fmt: skip
    pvc = {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": ns},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": f"{ns}-{claim}",
                 "resources": {"requests": {"storage": "10Gi"}}},
    }  # fmt: skip
    cluster.apply([pv, pvc])
    return host


def example(name: str | None = None, **spec: Any) -> dict[str, Any]:
    """examples/tiny-cluster.yaml, optionally renamed (the claim follows) and with spec overrides."""
    job: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    if name is not None:
        job["metadata"]["name"] = name
        job["spec"]["weightSync"]["diskDelta"]["volumeClaim"] = f"{name}-shared"
    for key, value in spec.items():
        if isinstance(value, dict):
            job["spec"].setdefault(key, {}).update(value)
        else:
            job["spec"][key] = value
    return job


# ------------------------------------------------------------------------------------------- helpers


@dataclass
class Sample:
    """One status of the job as `kubectl get rljobs -w` delivered it."""

    t: float
    phase: str | None
    step: int | None
    version: int | None
    reward: float | None
    restarts: int | None = None


@dataclass
class Watch:
    """`kubectl get rljob NAME -w -o json` in a thread: every status the job goes through, in order."""

    cluster: ControlPlane
    ns: str
    job: str
    samples: list[Sample] = field(default_factory=list)
    _proc: subprocess.Popen[str] | None = None
    _thread: threading.Thread | None = None

    def __enter__(self) -> Watch:
        assert self.cluster.bin_dir is not None
        cmd = [str(self.cluster.bin_dir / "kubectl"), "--kubeconfig", str(self.cluster.kubeconfig)]
        cmd += ["get", "rljob", self.job, "-n", self.ns, "-w", "-o", "json"]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        decoder, buf = json.JSONDecoder(), ""
        for line in self._proc.stdout:
            buf += line
            while buf.strip():
                try:
                    obj, end = decoder.raw_decode(buf.lstrip())
                except json.JSONDecodeError:
                    break
                buf = buf.lstrip()[end:]
                st = obj.get("status") or {}
                self.samples.append(
                    Sample(
                        time.monotonic(),
                        st.get("phase"),
                        st.get("step"),
                        st.get("weightVersion"),
                        st.get("reward"),
                        st.get("restarts"),
                    )
                )

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
        if self._thread is not None:
            self._thread.join(10)

    def phases(self) -> list[str]:
        """The distinct phases in the order they appeared."""
        out: list[str] = []
        for s in self.samples:
            if s.phase and (not out or out[-1] != s.phase):
                out.append(s.phase)
        return out


def pods(cluster: ControlPlane, ns: str, job: str, role: str | None = None) -> list[dict[str, Any]]:
    sel = f"{JOB_LABEL}={job}" + (f",rl.lockstep.dev/role={role}" if role else "")
    items: list[dict[str, Any]] = cluster.get("pods", "-n", ns, "-l", sel)["items"]
    return items


def diagnose(cluster: ControlPlane, ns: str, lines: int = 40) -> str:
    """Every pod's phase and container states, the tail of its logs (and of its previous container),
    the job's status and the namespace's recent events: what a failed wait says."""
    out = [cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout]
    for pod in cluster.get("pods", "-n", ns)["items"]:
        name = pod["metadata"]["name"]
        states = [
            (c["name"], c.get("state"), c.get("restartCount"))
            for c in pod["status"].get("containerStatuses", [])
        ]
        out.append(f"--- {name} {pod['status'].get('phase')} {states}")
        for extra in ((), ("--previous",)):
            logs = cluster.kubectl(
                "logs", "-n", ns, name, "--all-containers", f"--tail={lines}", *extra, check=False
            )
            if logs.stdout.strip():
                out.append(f"[logs{' ' + extra[0] if extra else ''}]\n{logs.stdout}")
    jobs = cluster.get("rljobs", "-n", ns)["items"]
    out += [f"rljob {j['metadata']['name']}: {json.dumps(j.get('status'), indent=1)}" for j in jobs]
    out.append(
        cluster.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False).stdout[-4000:]
    )
    operator_log = cluster.kubectl(
        "logs",
        "-n",
        SYSTEM_NS,
        "-l",
        "app.kubernetes.io/name=lockstep-operator",
        f"--tail={lines}",
        check=False,
    )
    out.append(f"[operator logs]\n{operator_log.stdout}{operator_log.stderr}")
    return "\n".join(out)


def wait(
    cluster: ControlPlane, ns: str, pred: Callable[[], Any], what: str, timeout: float = RUN_TIMEOUT
) -> Any:
    """cluster.wait_for, and on timeout the pods' story (diagnose) in the error."""
    try:
        return cluster.wait_for(pred, timeout=timeout, what=what, interval=1.0)
    except TimeoutError as err:
        raise TimeoutError(f"{err}\n{diagnose(cluster, ns)}") from None


def job_status(cluster: ControlPlane, ns: str, job: str) -> dict[str, Any]:
    st: dict[str, Any] = cluster.get("rljob", job, "-n", ns).get("status") or {}
    return st


def finished(cluster: ControlPlane, ns: str, job: str) -> dict[str, Any]:
    """Wait for Succeeded or Failed; the status."""
    st: dict[str, Any] = wait(
        cluster,
        ns,
        lambda: (s := job_status(cluster, ns, job)).get("phase") in ("Succeeded", "Failed") and s,
        f"rljob {job} finished",
    )
    return st


def printed_row(cluster: ControlPlane, ns: str, job: str) -> dict[str, str]:
    """`kubectl get rljobs` as the user sees it: header -> cell of the job's row."""
    out = cluster.kubectl("get", "rljobs", "-n", ns).stdout.splitlines()
    header = out[0].split()
    starts = [out[0].index(h) for h in header]
    row = next(line for line in out[1:] if line.split()[0] == job)
    cells = [row[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    return dict(zip(header, cells, strict=True))


def container_pid(cluster: ControlPlane, pod: dict[str, Any]) -> int:
    """The host pid of a pod's main container process (the node shares the host's pid namespace)."""
    assert cluster.node is not None
    cid = pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    rows = cluster.node.ctr("tasks", "ls").stdout.splitlines()[1:]
    pid = next(int(r.split()[1]) for r in rows if r.split()[0] == cid)
    return pid


def fail_with(cluster: ControlPlane, ns: str, message: str) -> str:
    return f"{message}\n{diagnose(cluster, ns)}"


def kill_main_process(cluster: ControlPlane, pod: dict[str, Any]) -> None:
    """SIGKILL the pod's main container process from the host, as an OOM kill or a crash would."""
    os.kill(container_pid(cluster, pod), signal.SIGKILL)


def unguarded(cluster: ControlPlane, ns: str, job: str) -> list[str]:
    """The job's running pods that the real node's NetworkPolicy enforcer (kube-router) has no firewall
    chain for: each policy-selected pod gets a `-d <pod IP>/32 ... -j KUBE-POD-FW-...` rule."""
    assert cluster.node is not None
    rules = cluster.node.iptables_rules().splitlines()
    return [
        p["metadata"]["name"]
        for p in live(pods(cluster, ns, job))
        if p["status"].get("podIP")
        and not any(f"-d {p['status']['podIP']}/32" in r and "KUBE-POD-FW-" in r for r in rules)
    ]


def live(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods not being deleted."""
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


class JobEnded(AssertionError):
    """The job finished while a scenario still needed it running."""


def poll(cluster: ControlPlane, ns: str, pred: Callable[[], Any], what: str, timeout: float) -> Any:
    """Like `wait`, but a JobEnded raised by pred fails at once (other exceptions count as not yet)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            if value := pred():
                return value
        except JobEnded:
            raise
        except Exception as exc:  # a transient NotFound or kubectl hiccup: keep polling
            last = exc
        time.sleep(1.0)
    raise TimeoutError(
        f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}\n{diagnose(cluster, ns)}"
    )


SFT_STEPS = 20
"""SFT warm-start steps of the example in the scenario run (the example has 85)."""
STEPS = 200
"""RL steps of the example in the scenario run: the scenarios use about 50 to 70 (the job steps on
during the scale-up and the operator's restart, at 2-3 steps/s); the rest is margin so the last one
surely happens mid-run (at 70 the job once finished during the operator's restart). The margin costs
about a minute."""


# -------------------------------------------------------------------------------------------- tests


def test_a_bad_checkpoint_path_fails_the_job_with_the_reason(
    real_cluster: ControlPlane, real_namespace: str, operator: InClusterOperator
) -> None:
    cluster, ns, job = real_cluster, real_namespace, "tiny-bad"
    manifest = example(job, model={"checkpoint": "/models/not-there"})
    shared_volume(cluster, ns, f"{job}-shared")
    cluster.apply(manifest, namespace=ns)
    st = finished(cluster, ns, job)
    assert st["phase"] == "Failed", fail_with(cluster, ns, f"status: {st}")
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert "/models/not-there" in failed["message"], failed


def test_a_colocated_cpu_job_runs_to_success_over_the_network_transport(
    real_cluster: ControlPlane, real_namespace: str, operator: InClusterOperator
) -> None:
    """schedule.colocate on CPU: there is no device memory for the pods to share, so the WeightChannel
    picks the transport the pod network allows (broadcast, not cuda-ipc) and says why, and the job runs
    from apply to Succeeded on the real node (GPU colocation is refused: e2e/test_operator_reconcile.py)."""
    cluster, ns, job = real_cluster, real_namespace, "tiny-coloc"
    manifest = example(job, schedule={"colocate": True})
    manifest["spec"]["schedule"]["steps"] = 3
    manifest["spec"]["algorithm"]["sftWarmStart"]["steps"] = 2
    shared_volume(cluster, ns, f"{job}-shared")
    cluster.apply(manifest, namespace=ns)
    st = finished(cluster, ns, job)
    assert st["phase"] == "Succeeded", fail_with(cluster, ns, f"status: {st}")
    assert st["step"] == 3 and st["transport"] == "broadcast", st
    assert st["transportReason"].startswith(
        "colocated on CPU: the engine and trainer pods share no device memory"
    )


def test_delete_leaves_nothing(
    real_cluster: ControlPlane, real_namespace: str, operator: InClusterOperator
) -> None:
    """A running job deleted: every pod, Service, ConfigMap, Secret, NetworkPolicy and child goes."""
    cluster, ns, job = real_cluster, real_namespace, "tiny-gone"
    manifest = example(job)
    shared_volume(cluster, ns, f"{job}-shared")
    cluster.apply(manifest, namespace=ns)
    wait(
        cluster,
        ns,
        lambda: len(pods(cluster, ns, job)) >= 4,
        "the job's pods created",
        timeout=300,
    )
    cluster.kubectl("delete", "rljob", job, "-n", ns, "--wait=true", "--timeout=600s")
    kinds = "pods,services,configmaps,secrets,networkpolicies,serviceaccounts,roles,rolebindings"
    kinds += ",rolloutpools,trainergroups,weightchannels"

    def gone() -> bool:
        left = cluster.get(kinds, "-n", ns, "-l", f"{JOB_LABEL}={job}")["items"]
        return not left

    wait(cluster, ns, gone, f"nothing of {job} left", timeout=600)


def test_the_example_trains_to_success_through_scale_and_faults(
    real_cluster: ControlPlane, real_namespace: str, operator: InClusterOperator
) -> None:
    """examples/tiny-cluster.yaml (STEPS RL steps, 20 SFT steps) applied once; while it runs, in turn:

    1. apply -> Pending/Provisioning -> Preflight (the pre-flight runs in the pods) -> Running; Step,
       Version and Reward advance in `kubectl get rljobs` while it runs;
    2. trainer rank 1 SIGKILLed after the step-10 checkpoint: the gang restarts and resumes from the
       checkpoint on the shared volume (not from step 0);
    3. the engine's process SIGKILLed: a new engine pod, the job steps on;
    4. `kubectl scale rolloutpool <job>-rollout --replicas=2`: the new engine is Ready only with the
       current version; back to 1, and no sample of the steps after is lost;
    5. the operator stopped and started: no pod recreated or duplicated;
    and the job Succeeds with exactly STEPS steps, checkpoints and metrics on the shared volume, ranks and
    engines removed, the driver pod kept with its logs."""
    cluster, ns, job = real_cluster, real_namespace, "tiny-cluster"
    manifest = example()
    manifest["spec"]["schedule"]["steps"] = STEPS
    # A shorter SFT warm start than the example's 85 steps: what this run checks does not depend on how
    # well the policy starts, and every `make test` pays for it (README's run keeps the example as is).
    manifest["spec"]["algorithm"]["sftWarmStart"]["steps"] = SFT_STEPS
    save = manifest["spec"]["schedule"]["saveInterval"]
    host = shared_volume(cluster, ns, manifest["spec"]["weightSync"]["diskDelta"]["volumeClaim"])
    cluster.apply(manifest, namespace=ns)
    rows: list[dict[str, str]] = []
    events: dict[str, int] = {}  # scenario -> the job's step when it began

    def at(pred: Callable[[dict[str, Any]], bool], what: str, timeout: float = RUN_TIMEOUT) -> dict[str, Any]:
        """Wait until the job is Running and pred(status) holds; a few `kubectl get rljobs` rows on the
        way. Reads the watch's latest status (no process spawned on the 2 busy cores), and every 5th
        poll the apiserver's, in case the watch fell behind."""
        polls = iter(range(1 << 30))

        def check() -> dict[str, Any] | None:
            last = watch.samples[-1] if watch.samples else None
            if last is None or next(polls) % 5 == 4:
                st = live_status()
            else:
                st = {"phase": last.phase, "step": last.step, "weightVersion": last.version,
                      "restarts": last.restarts}  # fmt: skip
                if last.phase in ("Succeeded", "Failed"):
                    st = live_status()  # raises JobEnded with the pods' story
            if st.get("phase") == "Running" and st.get("step"):
                if len(rows) < 3:
                    rows.append(printed_row(cluster, ns, job))  # `kubectl get rljobs` during the run
                if pred(st):
                    return st
            return None

        st: dict[str, Any] = poll(cluster, ns, check, what, timeout)
        return st

    def live_status() -> dict[str, Any]:
        """The job's status; JobEnded if it already finished: every scenario must hit a live run."""
        st = job_status(cluster, ns, job)
        if st.get("phase") in ("Succeeded", "Failed"):
            raise JobEnded(fail_with(cluster, ns, f"the job ended before the scenario was done: {st}"))
        return st

    def step_now() -> int:
        return int(job_status(cluster, ns, job).get("step") or 0)

    def driver_restarts() -> int:
        statuses = cluster.get("pod", f"{job}-driver", "-n", ns)["status"].get("containerStatuses") or [{}]
        return int(statuses[0].get("restartCount", 0))

    with Watch(cluster, ns, job) as watch:
        # 1 + 2. Past the first checkpoint: kill trainer rank 1.
        st = at(lambda s: (s.get("step") or 0) >= save + 2, f"Running at step >= {save + 2}")
        events["rank"] = st["step"]
        # The job got here through its NetworkPolicies: the node's enforcer guards every pod of it.
        assert not unguarded(cluster, ns, job), fail_with(
            cluster, ns, f"pods outside NetworkPolicy: {unguarded(cluster, ns, job)}"
        )
        kill_t = time.monotonic()
        kill_main_process(cluster, cluster.get("pod", f"{job}-trainer-1", "-n", ns))
        at(
            lambda s: (s.get("restarts") or 0) >= 1 and (s.get("step") or 0) >= events["rank"] + 1,
            "the gang restarted and the job past the step of the kill again",
        )
        resumed = [s.step for s in watch.samples if s.t > kill_t and s.step is not None]

        # 3. Kill the engine.
        engine = live(pods(cluster, ns, job, "engine"))[0]
        events["engine"] = step_now()
        kill_main_process(cluster, engine)
        wait(
            cluster,
            ns,
            lambda: any(
                p["metadata"]["uid"] != engine["metadata"]["uid"]
                for p in live(pods(cluster, ns, job, "engine"))
            ),
            "a new engine pod",
            timeout=300,
        )
        at(
            lambda s: (s.get("step") or 0) >= events["engine"] + 2,
            "the job stepping on after the engine kill",
        )

        # 4. Scale the pool to 2 and back to 1.
        events["scale"] = step_now()
        restarts_before_scale = driver_restarts()
        cluster.kubectl("scale", "rolloutpool", f"{job}-rollout", "-n", ns, "--replicas=2")

        def two_current() -> dict[str, Any] | None:
            live_status()
            pool = cluster.get("rolloutpool", f"{job}-rollout", "-n", ns).get("status") or {}
            engines = pool.get("engines") or []
            return pool if len(engines) == 2 and all(e.get("ready") for e in engines) else None

        pool = poll(cluster, ns, two_current, "two engines ready", timeout=600)
        versions = {e["weightVersion"] for e in pool["engines"]}
        assert len(versions) == 1, pool  # a Ready engine holds the current version, the new one too
        new = next(
            p for p in live(pods(cluster, ns, job, "engine")) if p["metadata"]["name"] == f"{job}-rollout-1"
        )
        gate = next(c for c in new["status"]["conditions"] if c["type"] == "rl.lockstep.dev/weights-current")
        assert gate["status"] == "True", gate
        cluster.kubectl("scale", "rolloutpool", f"{job}-rollout", "-n", ns, "--replicas=1")
        wait(cluster, ns, lambda: len(live(pods(cluster, ns, job, "engine"))) == 1, "back to one engine", 300)
        events["down"] = step_now()

        # 5. The operator stopped mid-run and started again.
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in live(pods(cluster, ns, job))}
        operator.stop()
        time.sleep(2)
        operator.start()
        events["operator"] = step_now()
        at(
            lambda s: (s.get("step") or 0) >= events["operator"] + 3,
            "the job stepping on after the operator restart",
        )
        after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in live(pods(cluster, ns, job))}
        assert after == before, (before, after)  # nothing recreated, nothing added
        roles = sorted(p["metadata"]["labels"]["rl.lockstep.dev/role"] for p in live(pods(cluster, ns, job)))
        assert roles == ["driver", "engine", "trainer", "trainer"], roles
        # A scale-down that races a weight update repeats the update, it does not restart the driver.
        assert driver_restarts() == restarts_before_scale, fail_with(cluster, ns, "the driver restarted")
        print(f"steps when each scenario began: {events}; in the run: {time.monotonic() - kill_t:.0f} s")

        st = finished(cluster, ns, job)
        time.sleep(2)  # the watch's last events
    assert st["phase"] == "Succeeded", fail_with(cluster, ns, f"status: {st}")
    assert st["step"] == STEPS and st["weightVersion"] == STEPS, st  # exact, after every fault
    assert (st.get("restarts") or 0) >= 1, st
    assert 0.0 <= st["reward"] <= 1.0 and st.get("transport") == "broadcast", st

    # 1. The phases in order up to the first Running (a gang restart may pass through them again). The
    # pre-flight ran in the pods: the job's PreflightPassed Event tells its verdict. The Preflight phase
    # itself may be missed: when the check passes before the operator sees the pods ready, one pass goes
    # from Provisioning to Running (seen once in CI on 2 busy cores).
    phases = watch.phases()
    first = phases[: phases.index("Running") + 1] if "Running" in phases else phases
    assert [p for p in PHASES if p in first] == first and "Provisioning" in first, phases
    selector = f"involvedObject.kind=RLJob,involvedObject.name={job},reason=PreflightPassed"
    told = cluster.get("events", "-n", ns, "--field-selector", selector)["items"]
    assert told and told[0]["type"] == "Normal", (phases, told)
    assert phases[-1] == "Succeeded", phases
    # Step and Version advance while Running, sampled during the run (before the first fault).
    running = [s for s in watch.samples if s.phase == "Running" and s.t < kill_t]
    run_steps = sorted({s.step for s in running if s.step is not None})
    run_versions = sorted({s.version for s in running if s.version is not None})
    assert len(run_steps) >= 3 and len(run_versions) >= 3, (run_steps, run_versions)
    assert [s.step for s in running if s.step is not None] == sorted(
        s.step for s in running if s.step is not None
    )
    assert any(s.reward is not None for s in running)
    assert rows and rows[0]["PHASE"] == "Running" and rows[0]["STEP"].isdigit(), rows[:1]
    # 2. Resumed from the checkpoint at `save` (or a later one), not from 0.
    assert resumed and min(resumed) >= save, (events, resumed)
    group = cluster.get("trainergroup", f"{job}-trainer", "-n", ns)
    assert (group.get("status") or {}).get("restarts", 0) >= 1, group.get("status")

    # Checkpoints of the ranks on the shared volume; the driver's metrics beside them: every step
    # trained, and no sample lost in the steps after the scale-down.
    run_dir = host / "lockstep" / job
    assert any((run_dir / "trainer").iterdir()), sorted(str(p) for p in run_dir.rglob("*"))[:50]
    records = [json.loads(line) for line in (run_dir / "driver" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r.get("kind") == "train"]
    assert {r["step"] for r in trained} == set(range(1, STEPS + 1)), sorted({r["step"] for r in trained})
    after_down = [r for r in trained if events["down"] < r["step"] <= events["down"] + 5]
    assert after_down and all(r["failed_samples"] == 0 for r in after_down), (events, after_down[-3:])
    # The job ended: ranks and engines are removed (their resources freed), the driver pod stays
    # Succeeded with its logs.
    wait(
        cluster,
        ns,
        lambda: [p for p in pods(cluster, ns, job) if p["metadata"]["name"] != f"{job}-driver"] == [],
        "the ranks and engines removed after success",
        timeout=300,
    )
    driver = cluster.get("pod", f"{job}-driver", "-n", ns)
    assert driver["status"]["phase"] == "Succeeded", driver["status"]
