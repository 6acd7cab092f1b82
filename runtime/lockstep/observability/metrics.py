"""MetricsSink: one call per step writes a JSON line and updates Prometheus gauges.

Why it exists: every loop (sync, fully-async, SFT warm start) reports a flat dict of floats per step;
one sink fans it out to `metrics.jsonl` in the run dir (appended, so a resumed run continues the same
file) and, when a port is given, to a Prometheus endpoint on 127.0.0.1 with one gauge per metric name
(`lockstep_<name>`). Names are sanitised to Prometheus' [a-zA-Z0-9_] alphabet.

In a pod the endpoint binds $POD_IP on $LOCKSTEP_METRICS_PORT (the operator sets both and declares the
port `metrics`, which manifests/monitoring's PodMonitors and scrape config select); `serve_registry` is
the same endpoint for the engine's and the trainer's own registries. Each train step also sets
`lockstep_last_step_timestamp_seconds`, the series the "no step for N minutes" alert reads.

A resumed run redoes the steps after its checkpoint, so their rows would appear twice. `resumed(step)`
writes a `{"kind": "resume", "step": k}` marker; every later row of a step after k the file already had
is marked `"redone": 1`; `read_jsonl` returns the effective history: the rows a marker supersedes (steps
after k, written before the marker) are left out, so plots and sweeps count each step once
(`raw=True` returns every line). The warm start's rows (`sft`, `eval_init`) are numbered by their own
steps: only a start-over (k = -1, no checkpoint yet) supersedes them.

Who calls it: lockstep.driver.components and lockstep.driver.sft (the run's MetricsSink), lockstep.driver.fully_async; tests read the file with `read_jsonl`.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_BAD = re.compile(r"[^a-zA-Z0-9_]")
WARM_START_KINDS = frozenset({"sft", "eval_init"})
"""Row kinds numbered by the warm start's own steps, not by RL steps."""
METRICS_PORT_ENV = "LOCKSTEP_METRICS_PORT"
"""The Prometheus port of a role's process in a pod (set by the operator; unset or 0: no endpoint)."""


def metrics_host() -> str:
    """Where a metrics endpoint binds: the pod's IP in a pod ($POD_IP), else loopback."""
    return os.environ.get("POD_IP") or "127.0.0.1"


def metrics_port_from_env() -> int:
    """$LOCKSTEP_METRICS_PORT as a port (0 when unset); a bad value raises naming the variable."""
    raw = os.environ.get(METRICS_PORT_ENV, "0") or "0"
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"{METRICS_PORT_ENV}={raw!r} is not a port: set it to 0..65535 (0 = no endpoint)")
    return port


def serve_registry(registry: Any, port: int, host: str | None = None) -> int:
    """Serve `registry` at http://host:port/metrics on a daemon thread; returns the bound port."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host or metrics_host(), registry=registry)
    return int(server.server_address[1])


def prom_name(name: str) -> str:
    """Metric name -> Prometheus gauge name (`lockstep_` prefix, invalid characters -> `_`)."""
    return "lockstep_" + _BAD.sub("_", name)


class MetricsSink:
    """JSON-lines file plus optional Prometheus gauges (port 0 = no endpoint)."""

    def __init__(self, path: Path, prometheus_port: int = 0, host: str | None = None) -> None:
        self.path = Path(path)
        """The JSON-lines file (one object per record, with "kind" and "step")."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._last_step = _last_step(self.path)
        """The highest RL step of any row the file held before this run (-1: none): this run's rows of
        steps after its resumed step, up to it, are redone steps."""
        self._resumed_at = -1
        self._file = self.path.open("a", buffering=1)
        self._registry: Any = None
        self._gauges: dict[str, Any] = {}
        self._server: Any = None
        self.port = 0
        """The bound Prometheus port (0 when off)."""
        if prometheus_port:
            self._start_prometheus(prometheus_port, host)

    def _start_prometheus(self, port: int, host: str | None) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self._registry = CollectorRegistry()
        server, _thread = start_http_server(port, addr=host or metrics_host(), registry=self._registry)
        self._server = server
        self.port = int(server.server_address[1])
        self._registry.register(_Shared())

    def log(self, kind: str, step: int, metrics: Mapping[str, float]) -> None:
        """Record `metrics` of `step`; kind is "train", "eval", "sft" or anything a loop defines."""
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
        self._write(kind, step, clean)
        if self._registry is not None:
            self._set_gauges(kind, step, metrics)

    def record(self, kind: str, step: int, data: Mapping[str, Any]) -> None:
        """Record JSON data of `step` that is not a metric (e.g. the data positions a step trained on);
        no gauge."""
        self._write(kind, step, dict(data))

    def resumed(self, step: int) -> None:
        """A resumed run continues after `step`: rows of later steps written so far are superseded
        (read_jsonl leaves them out); this run's rows of those steps are marked redone."""
        self._resumed_at = step
        if self._last_step >= 0 or self.path.stat().st_size > 0:
            self._file.write(json.dumps({"kind": "resume", "step": step}) + "\n")

    def _write(self, kind: str, step: int, values: Mapping[str, Any]) -> None:
        row: dict[str, Any] = {"kind": kind, "step": step, **values}
        if self._resumed_at < step <= self._last_step and kind not in WARM_START_KINDS:
            row["redone"] = 1.0
        self._file.write(json.dumps(row) + "\n")

    def _set_gauges(self, kind: str, step: int, metrics: Mapping[str, float]) -> None:
        from prometheus_client import Gauge

        stamp = {"last_step_timestamp_seconds": time.time()} if kind == "train" else {}
        for key, value in {"step": float(step), **metrics, **stamp}.items():
            name = prom_name(key if kind == "train" else f"{kind}_{key}")
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = Gauge(name, f"{kind} metric {key} (latest step)", registry=self._registry)
                self._gauges[name] = gauge
            gauge.set(float(value))

    def close(self) -> None:
        self._file.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


_SHARED: list[Any] = []


def share_registry(registry: Any) -> None:
    """Serve `registry`'s series at this process's MetricsSink endpoint too: the driver's in-process
    session server (tito_* series) shows up on the driver pod's `metrics` port."""
    if registry not in _SHARED:
        _SHARED.append(registry)


class _Shared:
    """A collector yielding the shared registries' series at scrape time (registries do not nest)."""

    def collect(self) -> Any:
        for registry in list(_SHARED):
            yield from registry.collect()

    def describe(self) -> list[Any]:
        return []  # nothing to check at registration: the shared registries come and go


def read_jsonl(path: Path, kind: str | None = None, *, raw: bool = False) -> list[dict[str, Any]]:
    """The records of a metrics file (optionally one kind), in order: the effective history, where a
    `resume` marker at step k drops the rows of steps after k written before it (a resumed run redid
    those steps); raw=True returns every line, markers included."""
    p = Path(path)
    if not p.exists():
        return []
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    if not raw:
        rows = _effective(rows)
    return [r for r in rows if kind is None or r.get("kind") == kind]


def _effective(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows without the ones a later resume marker supersedes, and without the markers."""
    keep = [True] * len(rows)
    for i, r in enumerate(rows):
        if r.get("kind") != "resume":
            continue
        keep[i] = False
        for j in range(i):
            warm = rows[j].get("kind") in WARM_START_KINDS
            if keep[j] and rows[j].get("step", 0) > r["step"] and (r["step"] < 0 or not warm):
                keep[j] = False
    return [r for r, k in zip(rows, keep, strict=True) if k]


def _last_step(path: Path) -> int:
    """The highest RL step of any row in the file, -1 when it has none."""
    if not path.exists():
        return -1
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r.get("step", -1) for r in rows if r.get("kind") not in WARM_START_KINDS]
    return max((int(s) for s in steps if isinstance(s, int | float)), default=-1)
