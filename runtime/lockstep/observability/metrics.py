"""MetricsSink: one call per step writes a JSON line and updates Prometheus gauges.

Why it exists: every loop (sync, fully-async, SFT warm start) reports a flat dict of floats per step;
one sink fans it out to `metrics.jsonl` in the run dir (appended, so a resumed run continues the same
file) and, when a port is given, to a Prometheus endpoint on 127.0.0.1 with one gauge per metric name
(`lockstep_<name>`). Names are sanitised to Prometheus' [a-zA-Z0-9_] alphabet.

Who calls it: lockstep.driver, lockstep.driver.fully_async; tests read the file with `read_jsonl`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_BAD = re.compile(r"[^a-zA-Z0-9_]")


def prom_name(name: str) -> str:
    """Metric name -> Prometheus gauge name (`lockstep_` prefix, invalid characters -> `_`)."""
    return "lockstep_" + _BAD.sub("_", name)


class MetricsSink:
    """JSON-lines file plus optional Prometheus gauges (port 0 = no endpoint)."""

    def __init__(self, path: Path, prometheus_port: int = 0, host: str = "127.0.0.1") -> None:
        self.path = Path(path)
        """The JSON-lines file (one object per record, with "kind" and "step")."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._registry: Any = None
        self._gauges: dict[str, Any] = {}
        self._server: Any = None
        self.port = 0
        """The bound Prometheus port (0 when off)."""
        if prometheus_port:
            self._start_prometheus(prometheus_port, host)

    def _start_prometheus(self, port: int, host: str) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self._registry = CollectorRegistry()
        server, _thread = start_http_server(port, addr=host, registry=self._registry)
        self._server = server
        self.port = int(server.server_address[1])

    def log(self, kind: str, step: int, metrics: Mapping[str, float]) -> None:
        """Record `metrics` of `step`; kind is "train", "eval", "sft" or anything a loop defines."""
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"kind": kind, "step": step, **clean}) + "\n")
        if self._registry is not None:
            self._set_gauges(kind, step, metrics)

    def _set_gauges(self, kind: str, step: int, metrics: Mapping[str, float]) -> None:
        from prometheus_client import Gauge

        for key, value in {"step": float(step), **metrics}.items():
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


def read_jsonl(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """All records of a metrics file (optionally one kind), in order."""
    p = Path(path)
    if not p.exists():
        return []
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r.get("kind") == kind]
