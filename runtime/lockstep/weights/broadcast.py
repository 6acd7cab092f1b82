"""Broadcast weight transport: one source rank broadcasts every bucket to every engine rank (§7.2.2).

Why it exists: it is the default when trainer and engines are on different GPUs and share a NCCL (or,
on CPU, gloo) network, and it needs no target-side resharding. The engines join one weight-update
group through /init_weights_update_group; per bucket the source posts names, dtypes and shapes
(/update_weights_from_distributed, one call per engine, concurrently) and broadcasts the tensors as
collectives; the version is set only after every bucket arrived. The group has a fixed world size,
so when the engines change (`follow`) the old group is destroyed on the engines that stay and the
next update builds a new one. docs/weights.md has the details.

Who calls it: the trainer (as a WeightTransport), preflight.py, tests and bench/weights_broadcast.py.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lockstep.serving.client import EngineClient
from lockstep.serving.loop import LoopThread
from lockstep.serving.weight_group import (
    WeightUpdateGroup,
    on_the_wire,
    open_weight_update_group,
    size_preamble,
)
from lockstep.weights import phases
from lockstep.weights.pipeline import Bucket, PipelineConfig, send_buckets
from lockstep.weights.transport import TransferReport

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

STAGE_LOCK = threading.Lock()
"""Held while one bucket is flushed, so broadcasts of different stages in one process never interleave."""


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on `host` for the group's rendezvous store."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class EngineTarget:
    """One engine server that joins the group."""

    url: str
    """Base URL, e.g. http://127.0.0.1:30000."""
    ranks: int = 1
    """GPUs (TP ranks) of the engine; each is one rank of the group."""


class BroadcastTransport:
    """WeightTransport over one torch.distributed group: this process is rank 0 (the source)."""

    name = "broadcast"

    def __init__(
        self,
        engines: list[EngineTarget],
        *,
        backend: str = "gloo",
        device: str = "cpu",
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str = "lockstep-stage-0",
        config: PipelineConfig | None = None,
        pause_mode: str | None = "retract",
        lock: Any = STAGE_LOCK,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 300.0,
    ) -> None:
        if not engines:
            raise ValueError("engines is empty: the broadcast transport needs at least one engine to send to")
        self.engines = engines
        self.backend, self.device = backend, device
        self.master_address = master_address
        self.master_port = master_port or free_port(master_address)
        self.group_name = group_name
        self.base_group_name = group_name
        """The first group's name; the group after the n-th change of engines is `<base>-m<n>`."""
        self.generation = 0
        """How many times the engines changed (each change builds a new group)."""
        self.config = config or PipelineConfig()
        self.pause_mode = pause_mode
        self.lock = lock
        self.clock = clock
        self.timeout_s = timeout_s
        self._io = LoopThread("broadcast-io")
        self._clients = [EngineClient(e.url, timeout_s=timeout_s) for e in engines]
        self.group: WeightUpdateGroup | None = None

    @property
    def world_size(self) -> int:
        return 1 + sum(e.ranks for e in self.engines)

    def connect(self) -> None:
        """Create the group: every engine joins via HTTP while this thread hosts rank 0."""
        if self.group is not None:
            return
        offsets = [1 + sum(e.ranks for e in self.engines[:i]) for i in range(len(self.engines))]
        joins = [
            self._io.submit(
                c.init_weights_update_group(
                    self.master_address,
                    self.master_port,
                    off,
                    self.world_size,
                    group_name=self.group_name,
                    backend=self.backend,
                )
            )
            for c, off in zip(self._clients, offsets, strict=True)
        ]
        self.group = open_weight_update_group(
            backend=self.backend,
            master_address=self.master_address,
            master_port=self.master_port,
            rank=0,
            world_size=self.world_size,
            group_name=self.group_name,
            timeout_s=self.timeout_s,
            announce_sizes=True,
        )
        for j in joins:
            j.result(self.timeout_s)

    def _all(self, make: Callable[[EngineClient], Any]) -> None:
        futures = [self._io.submit(make(c)) for c in self._clients]
        for f in futures:
            f.result(self.timeout_s)

    def send_bucket(self, bucket: Bucket) -> None:
        """Control message to every engine, then the data as collectives (async, waited together)."""
        import torch
        import torch.distributed as dist

        assert self.group is not None
        named = [(n, t.to(self.device).contiguous()) for n, t in bucket.named_tensors]
        names = [n for n, _ in named]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
        shapes = [list(t.shape) for _, t in named]
        with self.lock:
            with phases.phase("transfer"):
                replies = [
                    self._io.submit(
                        c.update_weights_from_distributed(
                            names, dtypes, shapes, group_name=self.group_name, flush_cache=False
                        )
                    )
                    for c in self._clients
                ]
                if self.group.announces_sizes():  # every engine checks it before posting the data
                    preamble = torch.tensor(size_preamble(names, dtypes, shapes), dtype=torch.int64)
                    self.group.broadcast(preamble.to(self.device), src=0)
                opts = dist.BroadcastOptions()
                opts.rootRank, opts.rootTensor = 0, 0
                works = [self.group.pg.broadcast([on_the_wire(t)], opts) for _, t in named]
                for w in works:
                    w.wait()
            with phases.phase("engine_load"):  # the engines stage and swap what they received
                for r in replies:
                    r.result(self.timeout_s)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> TransferReport:
        with phases.measure(self.clock) as timer:
            with phases.phase("membership"):
                self.connect()
            if self.pause_mode is not None:
                mode = self.pause_mode
                with phases.phase("pause"):
                    self._all(lambda c: c.pause_generation(mode))
            try:
                tensors, payload = send_buckets(named_tensors, self.config, self.send_bucket)
                with phases.phase("commit"):
                    self._all(lambda c: c.flush_cache())
                    # Only now, with every tensor loaded on every engine, does the version change.
                    self._all(lambda c: c.update_weight_version(version))
            finally:
                if self.pause_mode is not None:
                    with phases.phase("resume"):
                        self._all(lambda c: c.continue_generation())
        wire = payload * sum(e.ranks for e in self.engines)
        report = TransferReport(
            version=version,
            transport=self.name,
            tensors=tensors,
            payload_bytes=payload,
            wire_bytes=wire,
            extra={"update_weights_wire_bytes": float(wire)},
        )
        return timer.stamp(report)

    def follow(self, urls: list[str]) -> None:
        """Broadcast to exactly these engines from the next update on: a new group when they changed."""
        if sorted(urls) == sorted(e.url for e in self.engines):
            return
        refused = self._destroy_group(set(urls))
        if refused:
            # An engine that keeps the old group cannot join the new one: the next update names it.
            log.warning("engines %s did not destroy group %s", ", ".join(refused), self.group_name)
        for c in self._clients:
            self._io.run(c.aclose())
        ranks = {e.url: e.ranks for e in self.engines}
        self.engines = [EngineTarget(u, ranks.get(u, 1)) for u in sorted(urls)]
        self._clients = [EngineClient(e.url, timeout_s=self.timeout_s) for e in self.engines]
        self.generation += 1
        self.group_name = f"{self.base_group_name}-m{self.generation}"
        self.master_port = free_port(self.master_address)

    def close(self) -> None:
        self._destroy_group(None)
        for c in self._clients:
            self._io.run(c.aclose())
        self._io.close()

    def _destroy_group(self, staying: Collection[str] | None, leaving_wait_s: float = 2.0) -> list[str]:
        """Ask every engine to destroy the group (SGLang's /destroy_weights_update_group) so that it can
        join the next one. Engines whose URL is in `staying` (all when None) are waited for; the others
        are leaving (their pod may be gone) and get `leaving_wait_s` at most. Returns the staying URLs
        that refused or could not be reached; the group is dropped on this side either way."""
        failed: list[str] = []
        if self.group is not None:
            futures = [
                (c.base_url, self._io.submit(c.destroy_weights_update_group(self.group_name)))
                for c in self._clients
            ]
            for url, f in futures:
                stays = staying is None or url in staying
                try:
                    f.result(self.timeout_s if stays else leaving_wait_s)
                except Exception:  # a dying engine; named to the caller when it was meant to stay
                    if stays:
                        failed.append(url)
            self.group.close()
            self.group = None
        return failed
