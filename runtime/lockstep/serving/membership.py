"""Which engines a weight update must reach: a static URL list, or every pod behind the pool's headless Service.

Why it exists: in a cluster the rollout pool's engines come and go, and an update through the
load-balanced router reaches one engine only. Updates therefore go to each engine's own address,
asked for again before every update: the headless Service `<pool>-engines` (LOCKSTEP_ENGINES_SERVICE,
publishNotReadyAddresses) lists every engine pod's IP, ready or not, so a new engine (base checkpoint,
not Ready) is updated and then becomes Ready. A local run or a test names its engines
(`StaticMembers`, `--engine-url`). It sits below the driver and the trainer because both ask it: the
trainer's weight updates (lockstep.weights.transport.EngineSet) and the driver's progress report.

Who calls it: lockstep.weights.transport, lockstep.trainer, lockstep.driver.report, lockstep.cli.trainer,
tests (an injected resolver maps one name to loopback addresses).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

ENGINES_SERVICE_ENV = "LOCKSTEP_ENGINES_SERVICE"
"""Env var the operator sets on the driver and rank pods: the pool's headless Service listing every engine."""
ROUTER_URL_ENV = "LOCKSTEP_ROUTER_URL"
"""Env var of the pool's load-balanced router (rollouts only: an update through it reaches one engine)."""
ENGINE_PORT = 30000
"""The engines' HTTP port (SGLang's default; the operator's engine pods listen on it)."""


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
