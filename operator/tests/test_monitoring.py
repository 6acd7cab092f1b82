"""manifests/monitoring checked by Prometheus' own tool: the rules load, every alert fires on the series
a failure produces (and not on a healthy job) under `promtool test rules`, the plain scrape config is
valid, and every file equals what manifests/monitoring/build.py writes.

promtool comes from `make controlplane` (e2e/controlplane/prometheus/install.sh builds it from its
pinned module once); where it was never built this skips naming that command, so `make check` on a
fresh clone does not compile Prometheus. `make test` builds it first, so there these always run.
The e2e counterpart (a real Prometheus scraping the example job) is e2e/test_prometheus.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from e2e.controlplane.promserver import PrometheusError, promtool

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "manifests" / "monitoring"
RULE_TESTS = Path(__file__).resolve().parent / "monitoring" / "lockstep.rules.test.yaml"


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return promtool(*args, cwd=cwd, build=False)
    except PrometheusError as e:
        pytest.skip(str(e))


def test_files_are_what_build_writes() -> None:
    out = subprocess.run(
        [sys.executable, str(MONITORING / "build.py"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_rules_load_and_fire_on_failures_only() -> None:
    check = _promtool("check", "rules", str(MONITORING / "lockstep.rules.yaml"))
    assert check.returncode == 0, check.stdout + check.stderr
    tested = _promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    alerts = {r["alert"] for g in yaml.safe_load((MONITORING / "lockstep.rules.yaml").read_text())["groups"]
              for r in g["rules"] if "alert" in r}  # fmt: skip
    cases = RULE_TESTS.read_text()
    untested = sorted(a for a in alerts if f"alertname: {a}" not in cases)
    assert not untested, f"alerts without a promtool case in {RULE_TESTS.name}: {untested}"


def test_scrape_config_is_valid_and_prometheusrule_wraps_the_same_rules() -> None:
    check = _promtool("check", "config", "prometheus.yaml", cwd=MONITORING)
    assert check.returncode == 0, check.stdout + check.stderr
    plain = yaml.safe_load((MONITORING / "lockstep.rules.yaml").read_text())
    crd = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    assert crd["kind"] == "PrometheusRule" and crd["spec"] == plain


def test_dashboard_panels_each_have_one_query() -> None:
    board = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert panels and all(len(p["targets"]) == 1 and p["targets"][0]["expr"] for p in panels)
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
