"""Which engines a weight update must reach: a static URL list, or every pod behind the pool's headless Service.

Why it exists: in a cluster the rollout pool's engines come and go, and an update through the
load-balanced router reaches one engine only. Updates therefore go to each engine's own address,
asked for again before every update: the headless Service `<pool>-engines` (LOCKSTEP_ENGINES_SERVICE,
publishNotReadyAddresses) lists every engine pod's IP, ready or not, so a new engine (base checkpoint,
not Ready) is updated and then becomes Ready. A local run or a test names its engines
(`StaticMembers`, `--engine-url`). It sits below the driver and the trainer because both ask it: the
trainer's weight updates (lockstep.weights.transport.EngineSet) and the driver's progress report.

Sessions need the other view: the engines a turn may go to now, i.e. the ready endpoints of the
pool's router Service (ready = at the job's current weight version), read from its EndpointSlices
(`EndpointSliceMembers`; the driver's Role may list them), so that the driver's session server can
keep each session on one engine (lockstep.rollout.session.engine.LiveReplicaPool) instead of letting
the Service's load balancing scatter its turns. When the driver may not list them (a Role edited by
hand, a cluster policy stripping the verb: 403), routing falls back to the headless Service's engines
that answer /health (`HealthyMembers`; DNS needs no RBAC) and says once, naming the missing verb.

Who calls it: lockstep.weights.transport, lockstep.trainer, lockstep.progress, lockstep.cli.trainer,
lockstep.rollout.session (session routing), tests (an injected resolver maps one name to loopback
addresses).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx

from lockstep.kube import api_client

log = logging.getLogger(__name__)

ENGINES_SERVICE_ENV = "LOCKSTEP_ENGINES_SERVICE"
"""Env var the operator sets on the driver and rank pods: the pool's headless Service listing every engine."""
ROUTER_URL_ENV = "LOCKSTEP_ROUTER_URL"
"""Env var of the pool's load-balanced router (rollouts only: an update through it reaches one engine)."""
NAMESPACE_ENV = "POD_NAMESPACE"
"""Every job pod's namespace (downward API)."""
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
"""The label naming an EndpointSlice's Service."""
ENGINE_PORT = 30000
"""The engines' HTTP port (SGLang's default; the operator's engine pods listen on it)."""
DELTA_AGENT_PORT = 30001
"""The disk-delta agent beside each engine (lockstep.weights.delta_agent; the operator's engine pods
run it for `transport: disk-delta` with a shared volume)."""


def resolve_addresses(host: str, port: int) -> list[str]:
    """Every IP address `host` resolves to (a headless Service's name: one per engine pod), sorted."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def engine_url(ip: str, port: int) -> str:
    """http://IP:PORT for one engine address (IPv6 in brackets)."""
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


class EngineMembers(Protocol):
    """The engines an update must reach now; asked again before every update."""

    def urls(self) -> list[str]:
        """Base URLs of the current engines, sorted; raises OSError when the source cannot answer."""
        ...

    def describe(self) -> str:
        """Where the members come from (named in errors and logs)."""
        ...


@dataclass(frozen=True, slots=True)
class StaticMembers:
    """A fixed list of engines (`--engine-url`, `lockstep run`, tests)."""

    fixed: tuple[str, ...]
    """The engines' base URLs."""

    def urls(self) -> list[str]:
        return sorted(u.rstrip("/") for u in self.fixed)

    def describe(self) -> str:
        return "engines " + ", ".join(self.fixed)


@dataclass(frozen=True, slots=True)
class ServiceMembers:
    """Every address of a headless Service: one engine pod each, ready or not (publishNotReadyAddresses).

    A name that does not resolve (a headless Service with no pods answers NXDOMAIN) is no member at
    all, not an error: the caller decides whether zero engines is acceptable.
    """

    host: str
    """DNS name of the pool's headless engines Service (LOCKSTEP_ENGINES_SERVICE)."""
    port: int = ENGINE_PORT
    """The engines' HTTP port."""
    resolve: Callable[[str, int], list[str]] = resolve_addresses
    """host, port -> IP addresses (DNS by default; tests inject loopback addresses)."""

    def urls(self) -> list[str]:
        try:
            addresses = self.resolve(self.host, self.port)
        except socket.gaierror:
            return []
        return sorted(engine_url(ip, self.port) for ip in addresses)

    def describe(self) -> str:
        return f"headless Service {self.host}:{self.port}"


@dataclass(slots=True)
class EndpointSliceMembers:
    """The ready endpoints of a Service, from its EndpointSlices (the `kubernetes` client; in a pod its
    ServiceAccount, which needs `list` on discovery.k8s.io endpointslices in `namespace`).

    An endpoint whose `ready` condition is false is not a member (an unset one is, as Kubernetes
    reads it); the port is the slice's port named `port_name`, else its first, else `port`. Each
    call lists afresh: the caller decides how often to ask.
    """

    service: str
    """The Service's name (the pool's router, `<pool>-router`)."""
    namespace: str
    """Its namespace (the job's)."""
    port: int = ENGINE_PORT
    """The port when a slice names none."""
    port_name: str | None = None
    """The slice port to use when a slice has several."""
    api: Any = None
    """A `kubernetes` ApiClient (lockstep.kube.api_client() at first use when None)."""
    fallback: EngineMembers | None = None
    """Where the engines come from while the list is forbidden (403); None: the 403 is an error."""
    forbidden: bool = field(default=False, init=False)
    """The last list was forbidden and `fallback` answered (the warning is logged once, at the first)."""
    _warned: bool = field(default=False, init=False, repr=False)

    def urls(self) -> list[str]:
        from kubernetes.client import DiscoveryV1Api
        from kubernetes.client.exceptions import ApiException

        if self.api is None:
            self.api = api_client()
        try:
            listed = DiscoveryV1Api(self.api).list_namespaced_endpoint_slice(
                self.namespace, label_selector=f"{SERVICE_NAME_LABEL}={self.service}"
            )
        except ApiException as e:
            if e.status == 403 and self.fallback is not None:
                return self._fall_back(e)
            raise OSError(
                f"listing {self.describe()}: {e.status} {e.reason} (the driver's Role needs verb list on "
                f"resource endpointslices of apiGroup discovery.k8s.io in namespace {self.namespace})"
            ) from e
        if self.forbidden:
            log.warning("session routing reads %s again (list is allowed now)", self.describe())
            self.forbidden = False
        urls: set[str] = set()
        for piece in listed.items:
            port = self._port(piece.ports or [])
            for ep in piece.endpoints or []:
                if ep.conditions is not None and ep.conditions.ready is False:
                    continue
                urls.update(engine_url(ip, port) for ip in (ep.addresses or [])[:1])
        return sorted(urls)

    def _fall_back(self, e: Any) -> list[str]:
        """The fallback's engines; the first time, a warning naming the missing verb and the fix. The list
        is tried again at every call, so routing returns to the EndpointSlices once the Role allows it."""
        assert self.fallback is not None
        if not self._warned:
            self._warned = True
            log.warning(
                "session routing cannot list %s: %s %s. Grant the driver's ServiceAccount verb \"list\" on "
                "resource \"endpointslices\" of apiGroup \"discovery.k8s.io\" in namespace %s (the operator's "
                "Role <job>-driver-sessions does). Falling back to %s: sessions keep their engine, but an "
                "engine that is up and not yet ready (not at the current weight version) may get turns.",
                self.describe(), e.status, e.reason, self.namespace, self.fallback.describe(),
            )  # fmt: skip
        self.forbidden = True
        return self.fallback.urls()

    def _port(self, ports: Sequence[Any]) -> int:
        named = [p.port for p in ports if p.port and (self.port_name is None or p.name == self.port_name)]
        return int(named[0]) if named else self.port

    def describe(self) -> str:
        return f"the EndpointSlices of Service {self.namespace}/{self.service}"


def router_service(url: str) -> str:
    """The Service name in a router URL http://NAME[.NAMESPACE...]:PORT (pure)."""
    host = urlsplit(url).hostname or ""
    return host.split(".", 1)[0]


def session_members(env: Mapping[str, str]) -> EndpointSliceMembers | None:
    """Where a driver pod's session server finds the live engines: the EndpointSlices of the pool's
    router Service (LOCKSTEP_ROUTER_URL, POD_NAMESPACE, in a pod), falling back to the engines of the
    headless Service (LOCKSTEP_ENGINES_SERVICE) that answer /health while the list is forbidden; None
    outside a pod (pure)."""
    url, namespace = env.get(ROUTER_URL_ENV), env.get(NAMESPACE_ENV)
    if not (url and namespace and env.get("KUBERNETES_SERVICE_HOST")):
        return None
    port = urlsplit(url).port or ENGINE_PORT
    headless = env.get(ENGINES_SERVICE_ENV)
    fallback = HealthyMembers(ServiceMembers(headless, port)) if headless else None
    return EndpointSliceMembers(router_service(url), namespace, port=port, fallback=fallback)


def members_from(
    engine_urls: Sequence[str], env: Mapping[str, str], *, port: int = ENGINE_PORT
) -> EngineMembers | None:
    """The update targets of a trainer rank: --engine-url when given, else the headless Service, else the
    router (one engine only: fine for a pool of one); None when nothing names an engine."""
    if engine_urls:
        return StaticMembers(tuple(engine_urls))
    if env.get(ENGINES_SERVICE_ENV):
        return ServiceMembers(env[ENGINES_SERVICE_ENV], port)
    if env.get(ROUTER_URL_ENV):
        return StaticMembers((env[ROUTER_URL_ENV],))
    return None


def probe_health(url: str, timeout_s: float = 2.0) -> bool:
    """True when the engine at `url` answers GET /health with 200 (one try; a new engine's first sign)."""
    try:
        return httpx.get(url.rstrip("/") + "/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass(frozen=True, slots=True)
class HealthyMembers:
    """The members of `source` that answer GET /health now (the fallback of session routing: the
    headless Service lists engines ready or not)."""

    source: EngineMembers
    healthy: Callable[[str], bool] = probe_health
    """url -> serving (GET /health; tests may inject)."""

    def urls(self) -> list[str]:
        return [u for u in self.source.urls() if self.healthy(u)]

    def describe(self) -> str:
        return f"the engines of {self.source.describe()} that answer /health"


def wait_for_serving(
    members: EngineMembers,
    timeout_s: float,
    *,
    poll_s: float = 1.0,
    healthy: Callable[[str], bool] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[str]:
    """The listed engines that serve (`healthy`: GET /health), once at least one does; the others join
    at a later update. Raises TimeoutError naming the membership source after `timeout_s`."""
    healthy = healthy or probe_health
    deadline = clock() + timeout_s
    while True:
        listed = members.urls()
        ready = [u for u in listed if healthy(u)]
        if ready:
            return ready
        if clock() >= deadline:
            raise TimeoutError(
                f"no engine serves in {members.describe()} after {timeout_s:.0f} s (listed: "
                f"{', '.join(listed) or 'none'}); check the rollout pool's engine pods, or pass --engine-url"
            )
        sleep(poll_s)
