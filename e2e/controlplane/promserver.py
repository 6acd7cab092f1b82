"""A real Prometheus for tests: find (or build) the pinned binaries, run one server, query its HTTP API.

Why it exists: the monitoring manifests (manifests/monitoring) are only worth shipping if a real
Prometheus discovers the job's pods through the Kubernetes API, scrapes them, and evaluates every rule
and dashboard query on what it scraped. This starts one on 127.0.0.1 (a free port, a throwaway TSDB)
and stops it with the test; `promtool()` is the binary the rule checks run.

Who calls it: e2e/test_prometheus.py, operator/tests/test_monitoring.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from e2e.controlplane.ports import free_ports

INSTALL = Path(__file__).resolve().parent / "prometheus" / "install.sh"


class PrometheusError(RuntimeError):
    """Prometheus could not be built, started, or answered with an error."""


def cached_bin() -> Path:
    """Where install.sh puts the pinned version's binaries ($LOCKSTEP_PROMETHEUS_BIN when set)."""
    env = os.environ.get("LOCKSTEP_PROMETHEUS_BIN")
    if env:
        return Path(env)
    mod = (INSTALL.parent / "go.mod").read_text().split()
    version = mod[mod.index("github.com/prometheus/prometheus") + 1]
    cache = Path(os.environ.get("LOCKSTEP_CACHE", Path.home() / ".cache" / "lockstep"))
    return cache / "prometheus" / version / "bin"


def find_bin(build: bool = True) -> Path:
    """The directory with prometheus and promtool: the cache (or $LOCKSTEP_PROMETHEUS_BIN), built from
    the pinned module by install.sh when missing and `build` (minutes of Go compilation, once)."""
    path = cached_bin()
    if all((path / tool).exists() for tool in ("prometheus", "promtool")):
        return path
    if not build:
        raise PrometheusError(f"no Prometheus in {path}: run `bash {INSTALL}` (make controlplane)")
    out = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True)
    if out.returncode != 0:
        raise PrometheusError(f"{INSTALL} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def promtool(*args: str, cwd: Path | None = None, build: bool = True) -> subprocess.CompletedProcess[str]:
    """Run promtool with `args` (not checked: the caller asserts on returncode and output)."""
    binary = find_bin(build) / "promtool"
    return subprocess.run([str(binary), *args], capture_output=True, text=True, cwd=cwd)


class Prometheus:
    """One Prometheus server on 127.0.0.1 with `config` (a dict) and the rule files copied beside it."""

    def __init__(self, config: dict[str, Any], rule_files: list[Path] | None = None) -> None:
        self.config = config
        self.rule_files = rule_files or []
        self.dir = Path(tempfile.mkdtemp(prefix="lockstep-prom-"))
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Prometheus:
        binary = find_bin() / "prometheus"
        config = dict(self.config)
        config["rule_files"] = [p.name for p in self.rule_files]
        for p in self.rule_files:
            shutil.copy(p, self.dir / p.name)
        (self.dir / "prometheus.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.port = free_ports(1)[0]
        log = (self.dir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [str(binary), f"--config.file={self.dir / 'prometheus.yaml'}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=info"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.dir,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise PrometheusError(f"prometheus not ready in 60 s: {self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if os.environ.get("LOCKSTEP_E2E_KEEP") != "1":
            shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        path = self.dir / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; returns `data`, raises PrometheusError with Prometheus' error otherwise."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (a scalar result comes back as one sample without labels)."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets", state="active")["activeTargets"])

    def rules(self) -> list[dict[str, Any]]:
        return [r for g in self.api("rules")["groups"] for r in g["rules"]]
