"""`kubectl lockstep`: what users of an RLJob type again and again, as one kubectl plugin.

Why it exists: following a job means `kubectl get rljob`, then finding its pods by label, then reading
the driver's metrics through a port-forward. The plugin does each in one command, through kubectl
itself (its kubeconfig, context and RBAC; no client library, no port-forward):
- `kubectl lockstep status JOB [-n NS]`: phase, step, version, reward, the conditions, every pod with
  its role, readiness and restarts, and the driver's latest step metrics, read from its `metrics` port
  through the API server's pod proxy (`kubectl get --raw .../pods/<driver>:9400/proxy/metrics`);
- `kubectl lockstep logs JOB ROLE [--index N] [-f] [--tail N]`: the logs of one role's pod (driver,
  engine replica N, trainer rank N);
- `kubectl lockstep dashboard`: where the Grafana dashboard and the monitoring manifests are.
Installed as scripts/kubectl-lockstep (copy it onto PATH); `python -m lockstep.cli.kubectl` is the same.
Needs only kubectl and this package (no torch import).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

GROUP = "rl.lockstep.dev"
METRICS_PORT = 9400
"""Every job pod's metrics port (lockstep_operator.resources.common.METRICS_PORT)."""
SHOWN = (
    ("step", "lockstep_step"),
    ("reward_mean", "lockstep_reward_mean"),
    ("loss", "lockstep_loss"),
    ("train_tokens", "lockstep_train_tokens"),
    ("time_train_s", "lockstep_time_train_s"),
    ("update_weights_s", "lockstep_update_weights_s"),
    ("weight_version", "lockstep_weight_version"),
    ("logprob_gap", "lockstep_train_rollout_logprob_abs_diff"),
    ("staleness_max", "lockstep_staleness_s_old_max"),
)
"""(shown name, driver series) of `status`'s metrics block, in order; absent series are left out."""


class PluginError(Exception):
    """A kubectl call failed or the job has no such pod; the message says what to do."""


def kubectl(args: Sequence[str], namespace: str | None) -> str:
    cmd = ["kubectl", *args, *(["-n", namespace] if namespace else [])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise PluginError(
            "kubectl is not on PATH: install it (https://kubernetes.io/docs/tasks/tools/)"
        ) from None
    if out.returncode != 0:
        raise PluginError(f"`{' '.join(cmd)}` failed: {out.stderr.strip()}")
    return out.stdout


def pods(job: str, namespace: str | None, role: str | None = None) -> list[dict[str, Any]]:
    selector = f"{GROUP}/job={job}" + (f",{GROUP}/role={role}" if role else "")
    items: list[dict[str, Any]] = json.loads(
        kubectl(["get", "pods", "-l", selector, "-o", "json"], namespace)
    )["items"]
    return sorted(items, key=lambda p: p["metadata"]["name"])


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {series name: value} for the unlabelled series (the driver's gauges)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "{" in line:
            continue
        name, _, value = line.partition(" ")
        try:
            out[name] = float(value.split()[0])
        except (ValueError, IndexError):
            continue
    return out


def driver_metrics(driver: dict[str, Any]) -> dict[str, float]:
    ns, name = driver["metadata"]["namespace"], driver["metadata"]["name"]
    raw = kubectl(["get", "--raw", f"/api/v1/namespaces/{ns}/pods/{name}:{METRICS_PORT}/proxy/metrics"], None)
    return parse_metrics(raw)


def _ready(pod: dict[str, Any]) -> str:
    conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
    return "Ready" if conds.get("Ready") == "True" else pod.get("status", {}).get("phase", "?")


def status_lines(
    job: dict[str, Any], job_pods: list[dict[str, Any]], metrics: dict[str, float] | None
) -> list[str]:
    """What `status` prints (pure)."""
    st = job.get("status") or {}
    name = job["metadata"]["name"]
    lines = [
        f"RLJob {job['metadata'].get('namespace', '')}/{name}: phase {st.get('phase', '-')}, step {st.get('step', '-')}"
        f"/{job['spec'].get('schedule', {}).get('steps', '?')}, weight version {st.get('weightVersion', '-')}, "
        f"reward {st.get('reward', '-')}, transport {st.get('transport', '-')}, restarts {st.get('restarts', 0)}"
    ]
    for c in st.get("conditions", []):
        lines.append(
            f"  {c['type']}={c['status']} {c.get('reason', '')}: {c.get('message', '')}".rstrip(": ")
        )
    lines.append("pods:")
    for p in job_pods:
        labels = p["metadata"].get("labels", {})
        restarts = sum(c.get("restartCount", 0) for c in p.get("status", {}).get("containerStatuses", []))
        lines.append(
            f"  {labels.get(f'{GROUP}/role', '?'):8} {p['metadata']['name']:40} {_ready(p):10} restarts {restarts}"
        )
    if metrics is not None:
        shown = [f"{label} {metrics[series]:g}" for label, series in SHOWN if series in metrics]
        stamp = metrics.get("lockstep_last_step_timestamp_seconds")
        if stamp:
            shown.append(f"last step {time.time() - stamp:.0f} s ago")
        lines.append(
            "driver metrics (last step): " + (", ".join(shown) if shown else "none yet (no RL step)")
        )
    return lines


def status(args: argparse.Namespace) -> int:
    job = json.loads(kubectl(["get", "rljob", args.job, "-o", "json"], args.namespace))
    job_pods = pods(args.job, args.namespace)
    drivers = [p for p in job_pods if p["metadata"].get("labels", {}).get(f"{GROUP}/role") == "driver"]
    metrics = None
    if drivers and drivers[0].get("status", {}).get("phase") == "Running":
        try:
            metrics = driver_metrics(drivers[0])
        except PluginError as e:
            print(f"(driver metrics unavailable: {e})", file=sys.stderr)
    print("\n".join(status_lines(job, job_pods, metrics)))
    return 0


def logs(args: argparse.Namespace) -> int:
    candidates = pods(args.job, args.namespace, args.role)
    if args.role != "driver":
        key = f"{GROUP}/replica" if args.role == "engine" else f"{GROUP}/rank"
        candidates = [p for p in candidates if p["metadata"].get("labels", {}).get(key) == str(args.index)]
    if not candidates:
        raise PluginError(
            f"RLJob {args.job} has no {args.role} pod" + ("" if args.role == "driver" else f" with index {args.index}")
            + f": see `kubectl lockstep status {args.job}` for its pods"
        )  # fmt: skip
    cmd = ["logs", candidates[0]["metadata"]["name"], f"--tail={args.tail}", *(["-f"] if args.follow else [])]
    ns = ["-n", args.namespace] if args.namespace else []
    return subprocess.call(["kubectl", *cmd, *ns])


def dashboard(_: argparse.Namespace) -> int:
    print(
        "Grafana: import manifests/monitoring/grafana-dashboard.json (Dashboards > Import) and pick your Prometheus;\n"
        "scraping: manifests/monitoring/podmonitors.yaml + servicemonitor-operator.yaml (Prometheus Operator)\n"
        "or manifests/monitoring/prometheus.yaml; alerts: manifests/monitoring/prometheusrule.yaml (docs/monitoring.md)."
    )
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubectl lockstep", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="the job, its pods and the driver's latest step metrics")
    s.add_argument("job")
    s.set_defaults(run=status)
    lg = sub.add_parser("logs", help="the logs of one role's pod")
    lg.add_argument("job")
    lg.add_argument("role", choices=("driver", "engine", "trainer"))
    lg.add_argument("--index", type=int, default=0, help="engine replica or trainer rank (default 0)")
    lg.add_argument("-f", "--follow", action="store_true")
    lg.add_argument("--tail", type=int, default=100)
    lg.set_defaults(run=logs)
    d = sub.add_parser("dashboard", help="where the dashboard and the monitoring manifests are")
    d.set_defaults(run=dashboard)
    for sp in (s, lg):
        sp.add_argument("-n", "--namespace", default=None, help="the job's namespace (default: kubectl's)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        rc: int = args.run(args)
    except PluginError as e:
        print(f"kubectl lockstep: {e}", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
