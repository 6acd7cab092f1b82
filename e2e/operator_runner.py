"""The operator as the e2e tests run it: in-process (kopf.testing.KopfRunner, standalone, all
namespaces) for the kwok tests, or in the cluster from its image, installed by the Helm chart as users
install it (real-node tests).

One interface (start, stop, restart) for both, so a scenario exercises the same start and restart
whichever runs it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from e2e.controlplane.cluster import ControlPlane

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "lockstep"
RELEASE = "lockstep"
SYSTEM_NS = "lockstep-system"


class Operator:
    """The operator running in-process; `restart()` stops it and starts a fresh runner."""

    def __init__(self) -> None:
        self.runner: Any = None

    def start(self) -> None:
        from kopf.testing import KopfRunner

        args = ["run", "--standalone", "--all-namespaces", "-m", "lockstep_operator.handlers"]
        self.runner = KopfRunner(args, timeout=60)
        self.runner.__enter__()

    def stop(self) -> None:
        if self.runner is not None:
            self.runner.__exit__(None, None, None)
            self.runner = None

    def restart(self) -> None:
        self.stop()
        self.start()


def helm(cluster: ControlPlane, *args: str, timeout: float = 300) -> str:
    """The pinned helm (e2e/controlplane/helm, built by build.sh next to kubectl) on this cluster."""
    assert cluster.bin_dir is not None
    cmd = [str(cluster.bin_dir / "helm"), f"--kubeconfig={cluster.kubeconfig}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"helm {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr}")
    return proc.stdout


class InClusterOperator:
    """The operator Deployment from its image (`make images`' recipe, imported by the real node under
    its release reference), installed with `helm install` of charts/lockstep; `stop()` scales it to
    zero and waits until its pod is gone, `start()` scales it back and waits until it is Ready."""

    def __init__(self, cluster: ControlPlane, values: dict[str, Any]) -> None:
        self.cluster = cluster
        self.values = values
        self.replicas = int(values.get("replicas", 2))

    def install(self) -> None:
        """`helm install` with `values` (a values file, as a user would write one); waits until Ready."""
        assert self.cluster.work_dir is not None
        path = self.cluster.work_dir / "lockstep-values.yaml"
        path.write_text(yaml.safe_dump(self.values))
        # Its namespace enforces Pod Security "restricted", as manifests/namespace.yaml makes it.
        self.cluster.kubectl("create", "namespace", SYSTEM_NS)
        self.cluster.kubectl("label", "namespace", SYSTEM_NS, "pod-security.kubernetes.io/enforce=restricted")
        helm(self.cluster, "install", RELEASE, str(CHART), "-n", SYSTEM_NS, "-f", str(path))
        self._ready()

    def uninstall(self) -> None:
        helm(self.cluster, "uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", "--timeout=120s")
        self._gone()
        # Waited for: the next module's install creates it again, which fails while it terminates.
        self.cluster.kubectl("delete", "namespace", SYSTEM_NS, "--timeout=180s", timeout=200)

    def _pods(self) -> list[dict[str, Any]]:
        sel = "app.kubernetes.io/name=lockstep-operator"
        items: list[dict[str, Any]] = self.cluster.get("pods", "-n", SYSTEM_NS, "-l", sel)["items"]
        return items

    def _ready(self) -> None:
        self.cluster.kubectl(
            "rollout",
            "status",
            "deployment/lockstep-operator",
            "-n",
            SYSTEM_NS,
            "--timeout=600s",
            timeout=620,
        )

    def _gone(self) -> None:
        self.cluster.wait_for(lambda: not self._pods(), timeout=120, what="the operator's pods gone")

    def start(self) -> None:
        self.cluster.kubectl(
            "scale", "deployment/lockstep-operator", "-n", SYSTEM_NS, f"--replicas={self.replicas}"
        )
        self._ready()

    def stop(self) -> None:
        self.cluster.kubectl("scale", "deployment/lockstep-operator", "-n", SYSTEM_NS, "--replicas=0")
        self._gone()

    def restart(self) -> None:
        self.stop()
        self.start()

    def logs(self, lines: int = 60) -> str:
        """The tail of each operator pod's log (and its previous container's), for failure messages."""
        out = []
        for pod in self._pods():
            name = pod["metadata"]["name"]
            for extra in ((), ("--previous",)):
                proc = self.cluster.kubectl(
                    "logs", "-n", SYSTEM_NS, name, f"--tail={lines}", *extra, check=False
                )
                if proc.stdout.strip():
                    out.append(f"[operator {name}{' previous' if extra else ''}]\n{proc.stdout}")
        return "\n".join(out)
