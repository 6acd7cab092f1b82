"""`lockstep-operator` / `python -m lockstep_operator`: start the operator process.

Why it exists: process wiring in one place. It reads the settings once from the environment
(LOCKSTEP_OPERATOR_*), sets up structured JSON logs, serves Prometheus metrics, and runs kopf with
the handlers of lockstep_operator.handlers:
- HA: peering (several replicas, the highest priority one is active; needs the KopfPeering CRDs from
  manifests/kopf-peering.yaml, the object is created at start: handlers.ensure_peering) or standalone;
- probes: kopf's liveness endpoint on settings.health_port at /healthz (used for both liveness and
  readiness by manifests/deployment.yaml);
- metrics: prometheus_client on settings.metrics_port (/metrics), bound to $POD_IP (loopback outside a pod).
Never imports torch (operator/tests/test_no_torch.py).
"""

from __future__ import annotations

import logging
import os
import sys

import kopf
from prometheus_client import start_http_server

from lockstep_operator.settings import OperatorSettings, effective_priority, load_settings


def kopf_kwargs(settings: OperatorSettings, pod_name: str | None = None) -> dict[str, object]:
    """Arguments of kopf.run for these settings (pure; tested)."""
    kwargs: dict[str, object] = {}
    if settings.ha_mode == "standalone":
        kwargs["standalone"] = True
    else:
        kwargs["peering_name"] = settings.peering_name
        kwargs["priority"] = effective_priority(settings, pod_name)
    if settings.namespaces:
        kwargs["namespaces"] = list(settings.namespaces)
    else:
        kwargs["clusterwide"] = True
    if settings.health_port:
        kwargs["liveness_endpoint"] = f"http://0.0.0.0:{settings.health_port}/healthz"
    return kwargs


def main(argv: list[str] | None = None) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code."""
    try:
        settings = load_settings()
    except ValueError as err:
        print(f"lockstep-operator: {err}", file=sys.stderr)
        return 2
    kopf.configure(
        verbose=settings.log_level == "DEBUG",
        log_format=kopf.LogFormat.JSON if settings.log_format == "json" else kopf.LogFormat.FULL,
        log_refkey="object",
    )
    logging.getLogger().setLevel(settings.log_level)
    if settings.log_level != "DEBUG":  # the kubelet's probe every 5 s is not news (kopf's /healthz)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if settings.metrics_port:
        # The pod IP (downward API) where Prometheus scrapes it, loopback elsewhere; never every interface.
        start_http_server(settings.metrics_port, addr=os.environ.get("POD_IP") or "127.0.0.1")
    import lockstep_operator.handlers  # noqa: F401  (registers the handlers with kopf's default registry)

    kopf.run(**kopf_kwargs(settings, os.environ.get("POD_NAME")))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
