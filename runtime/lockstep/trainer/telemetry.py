"""The trainer group's Prometheus series: the commands rank 0 ran, how long they took, and its state.

Why it exists: a step that hangs in the trainer (a stuck collective, a slow weight push) is invisible
from the driver until its timeout; per-command counts and durations show where a step's time goes and
feed the dashboard's trainer panels and the weight-sync alert (manifests/monitoring). Every rank pod serves
them on $LOCKSTEP_METRICS_PORT (ranks > 0 only `lockstep_trainer_rank_info`, so no target is down).

Who calls it: lockstep.trainer.server (records around each command; serves on every rank), tests.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lockstep.observability.metrics import metrics_port_from_env, serve_registry

REGISTRY = CollectorRegistry()
"""This process's trainer series (a registry of its own: tests run several servers in one process)."""
COMMANDS = Counter(
    "lockstep_trainer_commands", "Commands run by rank 0, by command and result", ["command", "result"],
    registry=REGISTRY,
)  # fmt: skip
"""result: ok | error."""
COMMAND_SECONDS = Histogram(
    "lockstep_trainer_command_seconds",
    "Duration of one command on rank 0 (train: an optimizer step; update_weights: a weight sync)",
    ["command"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0),
    registry=REGISTRY,
)
READY = Gauge(
    "lockstep_trainer_ready", "1 while rank 0 takes commands (loaded, not draining)", registry=REGISTRY
)
RANK = Gauge("lockstep_trainer_rank_info", "This process's rank (value 1)", ["rank"], registry=REGISTRY)


def serve_from_env(rank: int) -> int:
    """Serve REGISTRY on $LOCKSTEP_METRICS_PORT when set (0: nothing served); returns the bound port.
    One endpoint per pod: only the pod's first process serves (torchrun's LOCAL_RANK 0), the others
    of a multi-GPU pod would find the port taken."""
    port = metrics_port_from_env()
    if not port or os.environ.get("LOCAL_RANK", "0") != "0":
        return 0
    RANK.labels(str(rank)).set(1)
    return serve_registry(REGISTRY, port)
