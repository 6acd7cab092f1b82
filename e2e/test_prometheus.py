"""A real Prometheus scrapes the example job on the real node; every dashboard query and rule returns data.

Why: manifests/monitoring (PodMonitors, the plain scrape config, rules, the Grafana dashboard) is only
worth shipping if what it selects exists. Here nothing is played: Prometheus (built from its pinned
module, e2e/controlplane/prometheus) runs manifests/monitoring/prometheus.yaml's scrape jobs — Kubernetes
pod discovery against the real apiserver, the same relabelling as the PodMonitors — and reaches the
driver, engine and trainer pods of examples/tiny-cluster.yaml over the pod network through their
NetworkPolicies, plus the operator's own pod in lockstep-system (Helm-installed, as in the other
real-pod tests; discovered the same way, job lockstep-operator). With the job stepping, it
evaluates lockstep.rules.yaml itself (every rule must evaluate with health ok), and the test queries:
- every dashboard panel's expression: data, except the panels of series only other kinds of job
  produce (ONLY_IN), whose expressions must still evaluate without error;
- every recording rule's series: data;
- every alert's selectors (an alert needs a failure to fire; promtool's cases in
  operator/tests/monitoring prove that it does): each selects series, but ONLY_IN's.
`kubectl lockstep status` (scripts/kubectl-lockstep) shows the same driver metrics through the API
server's pod proxy, and `kubectl lockstep logs` a role's log. Then the job is deleted (its end is
test_realpods.py's business). Costs one short run of the example
(5 SFT steps, then until Prometheus holds a few RL steps): a few minutes of `make test`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.controlplane.cluster import ControlPlane
from e2e.controlplane.promserver import Prometheus
from e2e.operator_runner import Operator
from e2e.test_realpods import diagnose, example, operator, runtime_image, shared_volume  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "manifests" / "monitoring"
ONLY_IN = {
    "lockstep_staleness_": "fully-async jobs (the example is sync: on-policy, no staleness to measure)",
    "lockstep_max_weight_staleness": "fully-async jobs with schedule.maxWeightStaleness",
    "tito_": "agent jobs (the driver's in-process session server)",
    # The other sglang:* series must have data: the engines serve them on the metrics port (the reference
    # engine itself, an SGLang pod through its metrics-relay sidecar), which every job policy admits.
    "sglang:token_usage": "SGLang engines (the reference engine has no paged KV pool to measure)",
    "sglang:time_to_first_token": "SGLang engines (the reference engine does not time first tokens)",
}
"""Series prefixes the example job cannot produce, and which jobs do."""
SCRAPE_S = 5
RL_STEPS = 4
"""RL steps Prometheus must have seen before the queries (rates over 5m need two samples or more)."""

pytestmark = pytest.mark.timeout(3600)  # cold: the runtime image is built and imported first


def _build() -> Any:
    spec = importlib.util.spec_from_file_location("monitoring_build", MONITORING / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(cluster: ControlPlane, ns: str, token_file: Path) -> dict[str, Any]:
    """manifests/monitoring's scrape config, pointed at this cluster: discovery through the real
    apiserver (its CA, a token file) in the test's namespace, and the operator's in lockstep-system
    as shipped; 5 s intervals so a short run has enough samples."""
    config: dict[str, Any] = _build().scrape_config()
    config["global"] = {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"}
    jobs = []
    for job in config["scrape_configs"]:
        job["scrape_interval"] = f"{SCRAPE_S}s"
        for sd in job["kubernetes_sd_configs"]:
            sd.update({
                "api_server": cluster.api_url,
                "tls_config": {"ca_file": str(cluster.ca_file)},
                "authorization": {"credentials_file": str(token_file)},
                "namespaces": sd.get("namespaces") or {"names": [ns]},  # the operator's: lockstep-system
            })  # fmt: skip
        jobs.append(job)
    config["scrape_configs"] = jobs
    return config


def _groups() -> list[dict[str, Any]]:
    import yaml

    groups: list[dict[str, Any]] = yaml.safe_load((MONITORING / "lockstep.rules.yaml").read_text())["groups"]
    return groups


SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})")


def _selectors(expr: str) -> list[str]:
    """The vector selectors of an expression that name a metric (`name{...}`)."""
    return [name + labels for name, labels in SELECTOR.findall(expr)]


def _only_in(expr: str) -> str | None:
    return next((why for prefix, why in ONLY_IN.items() if prefix in expr), None)


def test_prometheus_scrapes_the_example_and_every_query_returns_data(
    real_cluster: ControlPlane,
    real_namespace: str,
    operator: Operator,  # noqa: F811 (the fixture of test_realpods.py)
    tmp_path: Path,
) -> None:
    cluster, ns, job = real_cluster, real_namespace, "tiny-cluster"
    token_file = tmp_path / "token"
    token_file.write_text(cluster.admin_token)
    manifest = example()
    manifest["spec"]["algorithm"]["sftWarmStart"]["steps"] = 5  # the queries need RL steps, not a good policy
    # Still running when the queries run: a finished driver's pod leaves discovery and its series go
    # stale at once (the example's 40 steps take ~20 s); the job is deleted at the end.
    manifest["spec"]["schedule"]["steps"] = 100_000
    shared_volume(cluster, ns, manifest["spec"]["weightSync"]["diskDelta"]["volumeClaim"])
    config = _config(cluster, ns, token_file)
    try:
        with Prometheus(config, [MONITORING / "lockstep.rules.yaml"]) as prom:
            cluster.apply(manifest, namespace=ns)
            _wait_for_steps(cluster, ns, prom)
            failures = _check_once_rules_ran(prom)
            assert not failures, "\n".join(failures) + f"\n{prom.log_tail()}\n{diagnose(cluster, ns)}"
            _check_plugin(cluster, ns, job)
    finally:
        cluster.kubectl("delete", "rljob", job, "-n", ns, "--wait=false", check=False)


def _wait_for_steps(cluster: ControlPlane, ns: str, prom: Prometheus, timeout: float = 1500.0) -> None:
    """Until Prometheus has scraped RL_STEPS train steps from the driver and every role's target is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        up = {t["labels"].get("job"): t["health"] for t in prom.targets()}
        steps = prom.query('max(lockstep_step{job="lockstep-driver"})')
        if (
            steps
            and float(steps[0]["value"][1]) >= RL_STEPS
            and all(up.get(f"lockstep-{r}") == "up" for r in ("driver", "engine", "trainer", "operator"))
        ):
            return
        time.sleep(SCRAPE_S)
    targets = [(t["labels"], t["health"], t.get("lastError")) for t in prom.targets()]
    raise TimeoutError(f"no {RL_STEPS} RL steps scraped in {timeout:.0f} s; targets: {targets}\n"
                       f"{prom.log_tail()}\n{diagnose(cluster, ns)}")  # fmt: skip


def _check_once_rules_ran(prom: Prometheus) -> list[str]:
    """`_check`, again until it passes or every rule group has run three times since the steps were
    seen: a group runs every `interval` (15 s), so its first run after the driver appeared may have
    seen one sample of a series, too few for deriv() or rate() (no series until its next run)."""
    interval_s = max(_seconds(g.get("interval", f"{SCRAPE_S}s")) for g in _groups())
    deadline = time.monotonic() + 3 * interval_s + SCRAPE_S
    while (failures := _check(prom)) and time.monotonic() < deadline:
        time.sleep(SCRAPE_S)
    return failures


def _seconds(duration: str) -> float:
    """A Prometheus duration of one unit ("15s", "1m") in seconds."""
    return float(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]


def _check(prom: Prometheus) -> list[str]:
    """Every panel query, recorded series and alert selector; the failures as lines (empty: all good)."""
    failures = []
    for title, expr in _build().queries():
        result = prom.query(expr)  # an expression Prometheus refuses raises here
        if not result and _only_in(expr) is None:
            failures.append(f"panel {title!r}: no data for {expr}")
    evaluated = {r["name"]: r for r in prom.rules()}
    for group in _groups():
        for rule in group["rules"]:
            name = rule.get("record") or rule["alert"]
            state = evaluated.get(name)
            if state is None or state["health"] != "ok":
                failures.append(f"rule {name}: not evaluated ok by Prometheus: {state}")
            if "record" in rule and not prom.query(name):
                failures.append(f"recording rule {name}: no series")
            if "alert" in rule:
                prom.query(rule["expr"])  # evaluates (it may well be empty: nothing is failing)
                for sel in _selectors(rule["expr"]):
                    if not prom.query(sel) and _only_in(sel) is None:
                        failures.append(f"alert {name}: {sel} selects nothing")
    return failures


def _check_plugin(cluster: ControlPlane, ns: str, job: str) -> None:
    """The kubectl plugin against the same job: status with the driver's metrics, a role's logs."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "LOCKSTEP_PYTHON": sys.executable,
           "PATH": f"{cluster.bin_dir}:{os.environ['PATH']}"}  # fmt: skip
    plugin = str(ROOT / "scripts" / "kubectl-lockstep")
    out = subprocess.run([plugin, "status", job, "-n", ns], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "phase Running" in out.stdout and "driver metrics (last step): step " in out.stdout, out.stdout
    logs = subprocess.run(
        [plugin, "logs", job, "trainer", "-n", ns, "--tail", "5"], capture_output=True, text=True, env=env
    )
    assert logs.returncode == 0 and logs.stdout.strip(), logs.stderr
