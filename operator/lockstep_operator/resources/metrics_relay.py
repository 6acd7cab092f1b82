"""The metrics relay sidecar of an SGLang engine pod: SGLang's `sglang:*` series on the `metrics` port.

Why it exists: every job pod serves Prometheus text on port `metrics` (9400), the one port each job
NetworkPolicy admits from any source (resources.network); the engine PodMonitor and scrape job select
it (manifests/monitoring). The reference engine serves its `lockstep_engine_*` and `sglang:*` series
there itself. SGLang has no separate metrics port: it serves `sglang:*` (`--enable-metrics`) at GET
/metrics of its HTTP port, which the policy admits only from the job's driver and trainer pods (it
also serves /generate and the weight routes). So an SGLang engine pod gets a second container,
`metrics-relay` (the runtime image: `lockstep metrics-relay`, lockstep.observability.metrics_relay),
which answers GET /metrics on the pod IP's port 9400 with the engine's, fetched on the pod IP. The
`metrics` port is declared on it (port names are unique in a pod). SGLang lets /metrics through
without the API key, so the relay gets no Secret; the pod mounts no service-account token. Pure,
golden-tested.

Who calls it: resources.engines (engine_manifest) for SGLang engines.
"""

from __future__ import annotations

import copy

from lockstep_operator.resources.common import ENGINE_PORT, METRICS_PORT, POD_IP_ENV, Manifest

RELAY_NAME = "metrics-relay"
"""The sidecar's container name."""


def relay_command() -> list[str]:
    """`lockstep metrics-relay`: this pod's engine's /metrics, served on the pod IP's metrics port."""
    return [
        "lockstep", "metrics-relay",
        "--source", f"http://$({POD_IP_ENV}):{ENGINE_PORT}/metrics",  # the engine listens on the pod IP only
        "--host", f"$({POD_IP_ENV})",
        "--port", str(METRICS_PORT),
    ]  # fmt: skip


def with_metrics_relay(pod: Manifest, *, image: str) -> Manifest:
    """`pod` (an SGLang engine pod) with the relay sidecar serving the `metrics` port, run from `image`."""
    pod = copy.deepcopy(pod)
    spec = pod["spec"]
    main = spec["containers"][0]
    main["ports"] = [p for p in main["ports"] if p["name"] != "metrics"]
    spec["containers"].append(
        {
            "name": RELAY_NAME,
            "image": image,
            "imagePullPolicy": main.get("imagePullPolicy", "IfNotPresent"),
            "command": relay_command(),
            "env": [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
            "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }
    )
    return pod
