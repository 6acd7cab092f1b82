"""Weight pushes that follow the engine membership: every push reaches every engine of the pool.

Why it exists: a rollout pool's engines change while a job runs (a replaced pod, a scale-up, an engine
roll) and a new engine starts from the base checkpoint (version 0); it only becomes Ready (the
operator's rl.lockstep.dev/weights-current gate) once a push gave it the current version. So before
every push `MemberTransport` asks its `EngineMembers` (lockstep.serving.membership) for the engines of
the moment and has a follower adapt the transport:

- from-disk (auto): a full checkpoint per version and a reload per engine; the reloads are simply set
  to the current members, so a new engine loads the full version like every other.
- disk-delta: LocalDiskDelta.follow gives a new engine a verified baseline copy caught up through the
  delta chain, then the push patches and reloads it with the others.
- broadcast: the weight-update group has a fixed world size, so a changed membership destroys the old
  group on the engines that stay (POST /destroy_weights_update_group, SGLang's endpoint) and builds a
  new one (new group name, new port) with the current members before the push.
- p2p, cuda-ipc: the transport binds its engines at start; a changed membership fails the push with
  an error naming the engines and the fix, never silently skipping one.

An engine that joined is pushed to once it answers /health (a pod's address is listed from the moment
it has an IP, minutes before its server loads the model); until then it is logged as waiting. An
engine that left (gone from the list) is dropped. An engine that was reached before and no longer
answers fails the push, named in the error. Each push reports `weights_engines` (how many engines it
reached) and logs which.

Who calls it: lockstep.weights.factory.build_transport (wraps every transport it builds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from lockstep.serving.client import EngineClient
from lockstep.serving.membership import EngineMembers, probe_health

if TYPE_CHECKING:
    import torch

    from lockstep.serving.loop import LoopThread
    from lockstep.weights.broadcast import BroadcastTransport
    from lockstep.weights.disk_delta_local import LocalDiskDelta
    from lockstep.weights.from_disk import FromDiskTransport
    from lockstep.weights.transport import TransferReport, WeightTransport

log = logging.getLogger(__name__)


class MembershipChanged(RuntimeError):
    """The engines changed and this transport cannot follow; the message names them and the fix."""


class Follower(Protocol):
    """Keeps one transport in step with the membership."""

    def follow(self, urls: list[str]) -> WeightTransport:
        """Adapt to exactly these engines (sorted URLs); the transport the push goes through."""
        ...

    def close(self) -> None:
        """Release the transport and what the follower built."""
        ...


class MemberTransport:
    """WeightTransport over the engines `members` lists at each push (see the module docstring)."""

    def __init__(
        self,
        members: EngineMembers,
        follower: Follower,
        reached: Sequence[str],
        *,
        healthy: Callable[[str], bool] = probe_health,
    ) -> None:
        self.members = members
        """Where the engines of the moment come from."""
        self.follower = follower
        """Adapts the transport to them."""
        self.reached = sorted(reached)
        """The engines the last push reached (at start: those known ready)."""
        self.healthy = healthy
        """url -> whether a newly listed engine serves yet."""
        self.name = getattr(follower.follow(self.reached), "name", "weights")
        """The inner transport's name."""

    def current(self) -> list[str]:
        """The members to push to now: those listed that were reached before, and new ones that serve."""
        listed = self.members.urls()
        before = set(self.reached)
        urls = []
        for url in listed:
            if url in before or self.healthy(url):
                urls.append(url)
            else:
                log.info("engine %s is listed but does not serve yet; a later push reaches it", url)
        return urls

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> TransferReport:
        urls = self.current()
        if not urls:
            raise RuntimeError(
                f"weight push of version {version}: no engine serves in {self.members.describe()}; "
                "check the rollout pool's engine pods"
            )
        joined = sorted(set(urls) - set(self.reached))
        left = sorted(set(self.reached) - set(urls))
        if joined or left:
            log.info(
                "engines changed before version %d: joined %s, left %s", version, joined or "-", left or "-"
            )
        transport = self.follower.follow(urls)
        report = transport.push(named_tensors, version)
        self.reached = urls
        report.extra["weights_engines"] = float(len(urls))
        # Every step pushes: the engine list is logged at debug (membership changes are logged above).
        log.debug("version %d pushed (%s) to %d engines: %s", version, self.name, len(urls), ", ".join(urls))
        return report

    def close(self) -> None:
        self.follower.close()


def _named(url: str, fn: Callable[[], object]) -> None:
    """Run one engine's step; an error names the engine."""
    try:
        fn()
    except Exception as e:
        if url in str(e):
            raise
        raise RuntimeError(f"engine {url}: {type(e).__name__}: {e}") from e


class FromDiskFollower:
    """from-disk: every member reloads each full version (a new engine needs nothing else)."""

    def __init__(self, inner: FromDiskTransport, runner: LoopThread, clients: Sequence[EngineClient]) -> None:
        self.inner = inner
        """The checkpoint writer; its reloads are set before each push."""
        self.runner = runner
        """The event loop the engine clients run on."""
        self.given = {c.base_url: c for c in clients}
        """Clients the caller owns (closed by it)."""
        self.own: dict[str, EngineClient] = {}
        """Clients built here for engines that joined later (closed here)."""

    def _client(self, url: str) -> EngineClient:
        if url in self.given:
            return self.given[url]
        if url not in self.own:
            self.own[url] = EngineClient(url, retries=3)
        return self.own[url]

    def follow(self, urls: list[str]) -> WeightTransport:
        for url in [u for u in self.own if u not in urls]:
            self.runner.run(self.own.pop(url).aclose())  # that engine left

        def make_reload(url: str) -> Callable[[str, int], None]:
            client = self._client(url)

            def reload(path: str, version: int) -> None:
                _named(
                    url,
                    lambda: self.runner.run(client.update_weights_from_disk(path, weight_version=version)),
                )

            return reload

        self.inner.reloads = [make_reload(u) for u in urls]
        return self.inner

    def close(self) -> None:
        for client in self.own.values():
            self.runner.run(client.aclose())
        self.own.clear()
        self.inner.close()


class DiskDeltaFollower:
    """disk-delta: LocalDiskDelta.follow (new engines get a caught-up copy)."""

    def __init__(self, inner: LocalDiskDelta) -> None:
        self.inner = inner
        """The transport with one copy per engine."""

    def follow(self, urls: list[str]) -> WeightTransport:
        self.inner.follow(urls)
        return self.inner

    def close(self) -> None:
        self.inner.close()


class BroadcastFollower:
    """broadcast: a new weight-update group (name, port) whenever the members changed."""

    def __init__(self, make: Callable[[list[str], str], BroadcastTransport], urls: Sequence[str]) -> None:
        self.make = make
        """(engine URLs, group name) -> a transport whose group those engines join at its first push."""
        self.urls = sorted(urls)
        """The current group's engines."""
        self.generation = 0
        """How many groups were built before the current one."""
        self.transport: BroadcastTransport | None = None
        """The current group's transport (built on the first follow)."""

    def group_name(self) -> str:
        return "lockstep-stage-0" if self.generation == 0 else f"lockstep-stage-0-m{self.generation}"

    def follow(self, urls: list[str]) -> WeightTransport:
        if self.transport is not None and urls == self.urls:
            return self.transport
        if self.transport is not None:
            staying = set(urls) & set(self.urls)
            refused = self.transport.release(staying)
            if refused:
                # An engine that keeps the old group cannot join the new one: the push names it then.
                log.warning("engines %s did not destroy group %s", ", ".join(refused), self.group_name())
            self.generation += 1
        self.urls = sorted(urls)
        self.transport = self.make(self.urls, self.group_name())
        return self.transport

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class FixedFollower:
    """p2p, cuda-ipc: the transport's engines are fixed at start; a change fails the push, naming the fix."""

    def __init__(self, inner: WeightTransport, urls: Sequence[str], fix: str) -> None:
        self.inner = inner
        """The transport bound to `urls`."""
        self.urls = sorted(urls)
        """The engines it was built for."""
        self.fix = fix
        """What the error tells the user to do."""

    def follow(self, urls: list[str]) -> WeightTransport:
        if urls != self.urls:
            joined = sorted(set(urls) - set(self.urls))
            left = sorted(set(self.urls) - set(urls))
            raise MembershipChanged(
                f"spec.weightSync.transport {self.inner.name}: the engines changed since the trainer started "
                f"(joined: {', '.join(joined) or '-'}; left: {', '.join(left) or '-'}) and this transport cannot "
                f"reach a new set; {self.fix}"
            )
        return self.inner

    def close(self) -> None:
        self.inner.close()
