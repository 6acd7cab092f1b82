"""Kubernetes API access shared by the driver and the operator, on the maintained `kubernetes` client.

Why it exists: both processes talk to the API server through the `kubernetes` package (sync in the
driver, its asyncio API `kubernetes.aio` in the operator) and need three things the library leaves to
its caller: the ServiceAccount token re-read per request (bound tokens rotate; the library re-reads
once a minute), one retry policy for 429 and 5xx answers that honours Retry-After (the library retries
only reads), and in-cluster settings from a given ServiceAccount directory (tests use a real token).
docs/operator.md ("The Kubernetes client") says why this library and how it is tested.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where Kubernetes mounts a pod's ServiceAccount token, ca.crt and namespace."""
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
"""Answers worth another try: throttled, or the server (or a proxy in front of it) failed."""


class Configurable(Protocol):
    """What both `kubernetes.client.Configuration` and `kubernetes.aio.client.Configuration` offer."""

    host: str
    ssl_ca_cert: str | None
    api_key: dict[str, str]
    api_key_prefix: dict[str, str]
    refresh_api_key_hook: Any


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how long to wait before trying an API call again."""

    attempts: int = 5
    """Tries in all (1 = never retry)."""
    initial_s: float = 0.2
    """Pause after the first failure; doubles after each further one."""
    max_s: float = 10.0
    """Longest pause without a Retry-After."""
    max_retry_after_s: float = 60.0
    """Longest Retry-After honoured (a bigger hint waits this long)."""

    def delay(self, attempt: int, status: int | None, retry_after: str | None = None) -> float | None:
        """Seconds to wait after try `attempt` (1-based) failed with HTTP `status` (None: no answer,
        e.g. connection refused or a timeout); None when it must not be retried (a 4xx other than 429,
        or the tries are used up). A Retry-After in integer seconds wins over the backoff."""
        if attempt >= self.attempts or (status is not None and status not in RETRY_STATUSES):
            return None
        hinted = retry_after_seconds(retry_after)
        if hinted is not None:
            return min(hinted, self.max_retry_after_s)
        return float(min(self.initial_s * 2 ** (attempt - 1), self.max_s))


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header in integer seconds (the form the API server sends), else None."""
    if value is None or not value.strip().isdigit():
        return None
    return float(int(value.strip()))


def use_token_file(configuration: Configurable, path: Path) -> None:
    """Authenticate with the bearer token in `path`, read again before every request.

    The kubelet rewrites a projected ServiceAccount token (atomically, by swapping a symlink) long
    before it expires; reading the small file per request always sends the current one.
    """

    def refresh(conf: Configurable) -> None:
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"the token file {path} is empty: mount the ServiceAccount token there")
        conf.api_key["BearerToken"] = token

    configuration.api_key_prefix["BearerToken"] = "Bearer"
    configuration.refresh_api_key_hook = refresh
    refresh(configuration)


def in_cluster(
    configuration: Configurable, *, sa_dir: Path = SERVICE_ACCOUNT_DIR, env: Mapping[str, str] | None = None
) -> Configurable:
    """Fill `configuration` for the API server of the pod's own cluster (KUBERNETES_SERVICE_HOST/PORT,
    the ServiceAccount token re-read per request, its ca.crt)."""
    env = os.environ if env is None else env
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "443")
    token = sa_dir / "token"
    if not host or not token.exists():
        raise ValueError(
            f"not in a pod: KUBERNETES_SERVICE_HOST is {host or 'unset'} and {token} "
            f"{'exists' if token.exists() else 'is missing'}; set KUBECONFIG to reach a cluster from outside"
        )
    configuration.host = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    ca = sa_dir / "ca.crt"
    configuration.ssl_ca_cert = str(ca) if ca.exists() else None
    use_token_file(configuration, token)
    return configuration


def api_client() -> Any:
    """A sync `kubernetes` ApiClient: in a pod its ServiceAccount (in_cluster), else KUBECONFIG (tests,
    bench). The driver's users: sandbox claims (lockstep.sandbox.cluster) and session routing
    (lockstep.serving.membership.EndpointSliceMembers)."""
    from kubernetes import client, config

    conf = client.Configuration()
    try:
        in_cluster(conf)
    except ValueError:
        # KUBECONFIG read now: the client reads it once, at its import, which may come before it is set.
        config.load_kube_config(os.environ.get("KUBECONFIG"), client_configuration=conf)  # type: ignore[no-untyped-call]
    return client.ApiClient(conf)
