"""P2P weight transport through Mooncake's TransferEngine: each source writes only what a target needs (§7.2.3).

Why it exists: broadcast sends every byte from one rank per stage to every engine GPU. P2P lets many
trainer ranks write, by RDMA (TCP on CPU machines, same API), straight into each engine's registered
memory, and each target receives only its own shards: a pure transfer plan (`plan_transfers`), the
targets' buffer layout (`P2PTargetInfo`, served by lockstep.engine.ext_weights), resharding into the
target's TP layout (`shard_for_target`) and one reusable staging buffer per sender whose two halves
overlap packing with the wire. A failed write raises `P2PWriteError`, never only logged; each target
commits (checksums with verify=True) and only then advances its version. When the engines change,
`follow` fetches a joining engine's receive buffer and plans the transfers again; after a failed
update every target's info is fetched again. docs/weights.md has the details.

Who calls it: the trainer (as a WeightTransport), lockstep.engine.ext_weights (P2PReceiver), tests and
bench/weights_p2p.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from lockstep.api.auth import auth_headers
from lockstep.models import st_bytes as sb
from lockstep.weights import phases, reshard
from lockstep.weights.pipeline import PipelineConfig, prepare_buckets
from lockstep.weights.transport import TransferReport, refuse_change

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 256 * 1024 * 1024
"""Size of the one registered staging buffer of a sender."""

shard_dim = reshard.shard_dim


P2P_INFO_ROUTE = "/p2p_receiver_info"
"""GET: the engine's receive buffer and slots (P2PTargetInfo). Lockstep's one documented engine
extension (docs/sglang.md): the pinned SGLang has no receive side for trainer-pushed P2P writes."""
P2P_COMMIT_ROUTE = "/p2p_receiver_commit"
"""POST P2PCommitRequest: verify what arrived, load it, set the weight version."""


class P2PWriteError(RuntimeError):
    """A TransferEngine write (or the engine set-up) failed; the update did not happen."""


def plan_transfers(sources: int, targets: int) -> list[list[int]]:
    """Targets of each source: target i < min(S, T) goes to source i, the rest round-robin (pure).

    >>> plan_transfers(2, 5)
    [[0, 2, 4], [1, 3]]
    """
    if sources < 1 or targets < 0:
        raise ValueError(f"need sources >= 1 and targets >= 0, got sources={sources}, targets={targets}")
    plan: list[list[int]] = [[] for _ in range(sources)]
    for t in range(targets):
        plan[t if t < sources else (t - sources) % sources].append(t)
    return plan


def target_shape(name: str, shape: Iterable[int], tp_size: int, *, head_dim: int | None = None) -> list[int]:
    """Local shape of a tensor on one TP rank in SGLang's layout (lockstep.weights.reshard)."""
    return reshard.local_shape(name, shape, tp_size, head_dim=head_dim)


def shard_for_target(
    name: str, tensor: torch.Tensor, tp_rank: int, tp_size: int, local: Sequence[int] | None = None
) -> torch.Tensor:
    """The part of a full HF tensor that TP rank `tp_rank` of `tp_size` holds (contiguous), cut to the
    target slot's shape `local` when given (lockstep.weights.reshard)."""
    return reshard.shard(name, tensor, tp_rank, tp_size, local)


def group_of(info: P2PTargetInfo, name: str) -> tuple[int, int]:
    """(rank, size) of the group `name` is split over on a target: MoE TP for routed experts, else TP."""
    if reshard.is_routed_expert(name) and info.moe_tp_size is not None:
        return info.moe_tp_rank or 0, info.moe_tp_size
    return info.tp_rank, info.tp_size


class Slot(BaseModel):
    """Where one tensor lives in a target's receive buffer."""

    model_config = ConfigDict(extra="forbid")
    offset: int
    """Byte offset in the receive buffer."""
    nbytes: int
    """Byte size of the local (sharded) tensor."""
    dtype: str
    """torch dtype without the prefix, e.g. bfloat16."""
    shape: list[int]
    """Local (target-layout) shape."""


class P2PTargetInfo(BaseModel):
    """GET /p2p_receiver_info reply: what a source needs to write into one target."""

    model_config = ConfigDict(extra="forbid")
    session_id: str
    """TransferEngine peer name, host:rpc_port."""
    buffer_ptr: int
    """Address of the registered receive buffer in the target process."""
    buffer_bytes: int
    """Size of the receive buffer."""
    tp_rank: int
    """The target's TP rank."""
    tp_size: int
    """The target's TP size."""
    slots: dict[str, Slot]
    """Every tensor the target expects, by HF name (with expert parallel: only its own experts)."""
    moe_tp_rank: int | None = None
    """The target's rank in the MoE TP group routed experts are split over (tp / ep ranks); unset: tp_rank."""
    moe_tp_size: int | None = None
    """The MoE TP group's size; unset: tp_size (no expert parallel)."""


class P2PCommitRequest(BaseModel):
    """POST /p2p_receiver_commit body: load what arrived and advance the weight version."""

    model_config = ConfigDict(extra="forbid")
    version: int
    """The weight version the engine reports after loading."""
    names: list[str]
    """Every tensor written in this update; the target loads exactly these."""
    checksums: dict[str, str] = {}
    """xxh3-128 of written tensors' local bytes (all of them when the source verifies, else empty);
    the target refuses to load on any mismatch."""


def new_transfer_engine(hostname: str = "127.0.0.1", protocol: str = "tcp") -> Any:
    """A TransferEngine in P2PHANDSHAKE mode (no metadata server): peers are named host:rpc_port."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(hostname, "P2PHANDSHAKE", protocol, "")
    if rc != 0:
        raise P2PWriteError(
            f"TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}"
        )
    return engine


class P2PReceiver:
    """Engine side: one registered receive buffer in this target's layout, loaded on commit."""

    def __init__(
        self,
        expected: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
    ) -> None:
        import torch

        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.slots: dict[str, Slot] = {}
        offset = 0
        for name, (dtype, shape) in expected.items():
            local = target_shape(name, shape, tp_size)
            n = torch.Size(local).numel() * torch.empty((), dtype=dtype).element_size()
            offset = (offset + 63) // 64 * 64  # aligned slots keep every view well-formed
            self.slots[name] = Slot(
                offset=offset, nbytes=n, dtype=str(dtype).removeprefix("torch."), shape=local
            )
            offset += n
        self.buffer = torch.zeros(max(offset, 1), dtype=torch.uint8)  # [total bytes]
        self.engine = new_transfer_engine(hostname, protocol)
        if self.engine.register_memory(self.buffer.data_ptr(), self.buffer.numel()) != 0:
            raise P2PWriteError(f"register_memory of the {self.buffer.numel()}-byte receive buffer failed")
        self.session_id = f"{hostname}:{self.engine.get_rpc_port()}"

    def info(self) -> P2PTargetInfo:
        return P2PTargetInfo(
            session_id=self.session_id,
            buffer_ptr=self.buffer.data_ptr(),
            buffer_bytes=self.buffer.numel(),
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            slots=self.slots,
        )

    def view(self, name: str) -> torch.Tensor:
        """The received tensor (a view into the buffer) in its local dtype and shape."""
        import torch

        s = self.slots[name]
        raw = self.buffer[s.offset : s.offset + s.nbytes]
        return raw.view(getattr(torch, s.dtype)).view(s.shape)

    def verified(self, request: P2PCommitRequest) -> list[tuple[str, torch.Tensor]]:
        """The written tensors, after checking every checksum; raises naming the tensors that differ."""
        unknown = sorted((set(request.names) | set(request.checksums)) - set(self.slots))
        if unknown:
            raise ValueError(f"commit names tensors this target does not hold: {unknown[:5]}")
        bad = [n for n, c in request.checksums.items() if sb.checksum(sb.tensor_bytes(self.view(n))) != c]
        if bad:
            raise P2PWriteError(f"{len(bad)} tensors arrived damaged or not at all: {sorted(bad)[:10]}")
        return [(n, self.view(n)) for n in request.names]

    def close(self) -> None:
        self.engine.unregister_memory(self.buffer.data_ptr())


Commit = Callable[[P2PCommitRequest], None]
"""Tells one target to verify and load what arrived (HTTP POST /p2p_receiver_commit in production)."""


@dataclass(slots=True)
class P2PTarget:
    """One engine rank as a source sees it."""

    info: P2PTargetInfo
    """Its receive buffer and layout."""
    commit: Commit
    """Loads and activates the version once every source has written."""
    url: str = ""
    """The engine's base URL (http_target sets it; the engine set `follow` compares)."""


class _Staging:
    """The one registered staging buffer: packs (bytes, remote address) pieces and writes them in batches."""

    def __init__(self, engine: Any, nbytes: int) -> None:
        import torch

        pin = torch.cuda.is_available()  # page-locked memory only where a device will fill it
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)  # [staging bytes]
        self.engine = engine
        if engine.register_memory(self.buffer.data_ptr(), nbytes) != 0:
            raise P2PWriteError(f"register_memory of the {nbytes}-byte staging buffer failed")
        self.base = self.buffer.data_ptr()

    def write(self, session: str, pieces: list[tuple[int, int, int]], what: str) -> None:
        """Batched write of (staging offset, remote address, length) pieces; raises on any failure."""
        rc = self.engine.batch_transfer_sync_write(
            session,
            [self.base + o for o, _, _ in pieces],
            [a for _, a, _ in pieces],
            [n for _, _, n in pieces],
        )
        if rc != 0:
            raise P2PWriteError(f"write of {what} to {session} failed (TransferEngine returned {rc})")

    def close(self) -> None:
        self.engine.unregister_memory(self.base)


class _Pipe:
    """Double buffering inside the one staging buffer: one half is filled while the other is written.

    Writes run on a single background thread, so they reach the targets in submission order; a half
    is reused only after its previous write finished, and a failed write raises at that point or at
    drain(), never only logged.
    """

    def __init__(self, staging: _Staging, pool: ThreadPoolExecutor) -> None:
        self.staging, self.pool = staging, pool
        self.half = staging.buffer.numel() // 2
        self.staging_np = staging.buffer.numpy()  # [staging bytes] uint8 view, no copy
        if self.half < 1:
            raise ValueError("staging_bytes must be at least 2 (two halves)")
        self.pending: list[Future[None] | None] = [None, None]
        self.cur, self.used = 0, 0
        self.pieces: list[tuple[int, int, int]] = []
        self.session = ""
        self.last_name = ""

    def _wait(self, h: int) -> None:
        fut, self.pending[h] = self.pending[h], None
        if fut is not None:
            with phases.phase("transfer"):  # the packing that overlapped this write is charged to bucket
                fut.result()

    def add(self, session: str, data: torch.Tensor, remote: int, name: str) -> None:
        """Queue `data` ([n] uint8) for `remote` on `session`, copying it into staging chunk by chunk."""
        if session != self.session:
            self.flush()
            self.session = session
        done, total = 0, data.numel()
        data_np = data.numpy() if data.device.type == "cpu" else None  # [n] uint8 view, no copy
        while done < total:
            if self.used == self.half:
                self.flush()
            n = min(self.half - self.used, total - done)
            off = self.cur * self.half + self.used
            if data_np is not None:
                np.copyto(self.staging_np[off : off + n], data_np[done : done + n])  # a plain memcpy
            else:  # device -> pinned staging (DMA)
                self.staging.buffer[off : off + n].copy_(data[done : done + n])
            self.pieces.append((off, remote + done, n))
            self.used += n
            done += n
        self.last_name = name

    def flush(self) -> None:
        """Submit the current half's write and switch to the other half (waiting for its last write)."""
        if not self.pieces:
            return
        what = f"a chunk ending in {self.last_name}"
        self.pending[self.cur] = self.pool.submit(self.staging.write, self.session, self.pieces, what)
        self.cur ^= 1
        self.pieces, self.used = [], 0
        self._wait(self.cur)

    def drain(self) -> None:
        """Write what is queued and wait for every write; raises the first failure."""
        errors: list[BaseException] = []
        try:
            self.flush()
        except BaseException as e:
            errors.append(e)
        for h in (0, 1):
            try:
                self._wait(h)
            except BaseException as e:
                errors.append(e)
        if errors:
            raise errors[0]


def _cut(info: P2PTargetInfo, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The parts of a bucket's tensors one target holds, in its slots' shapes. A routed expert the
    target has no slot for lives on another expert-parallel rank; any other missing name is a layout
    mismatch (`_send` names it)."""
    out = []
    for name, t in named:
        slot = info.slots.get(name)
        if slot is None and reshard.is_routed_expert(name):
            continue
        rank, size = group_of(info, name)
        out.append((name, shard_for_target(name, t, rank, size, slot.shape if slot is not None else None)))
    return out


class P2PTransport:
    """WeightTransport: this source writes its planned targets' shards, then the targets commit."""

    name = "p2p"

    def __init__(
        self,
        targets: list[P2PTarget],
        *,
        source_rank: int = 0,
        num_sources: int = 1,
        config: PipelineConfig | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        verify: bool = False,
        clock: Callable[[], float] = time.monotonic,
        target_factory: Callable[[str], P2PTarget] | None = None,
    ) -> None:
        self.verify = verify
        """Send xxh3-128 checksums with the commit so each target checks every tensor before loading.
        Off by default: it costs two extra passes over the bytes (0.46 vs 1.01 of the raw rate on TCP
        loopback, bench/results/weights_p2p_*); failed writes raise either way, every expected tensor
        must have been written before any commit, and the pre-flight check covers silent misses."""
        self.source_rank, self.num_sources = source_rank, num_sources
        self.target_factory = target_factory
        """URL -> P2PTarget of an engine (its receive buffer and layout): how a joining engine is reached."""
        self.all_targets: list[P2PTarget] = []
        self.targets: list[P2PTarget] = []
        self.replans = 0
        """How many times the engine set changed and the transfer plan was made again."""
        self.last_replan_s = 0.0
        """Seconds the last re-plan took (the new engines' receive-buffer info included)."""
        self.stale = False
        """Set after a failed update: every target's info is fetched again before the next one (a
        restarted engine keeps its address but registers a new receive buffer)."""
        self._plan(targets)
        self.config = config or PipelineConfig()
        self.clock = clock
        self.engine = new_transfer_engine(hostname, protocol)
        self.staging = _Staging(self.engine, staging_bytes)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2p-write")
        self._lock = threading.Lock()

    def _prepared(
        self, named: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[list[list[tuple[str, torch.Tensor]]]]:
        """Per bucket, per target: the resharded tensors (runs while the previous bucket's last write flies)."""
        for bucket in prepare_buckets(named, self.config):
            yield [_cut(tg.info, bucket.named_tensors) for tg in self.targets]

    def _send(self, pipe: _Pipe, target: P2PTarget, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Pack one target's tensors of a bucket into staging; full halves are written in the background."""
        import torch

        info = target.info
        for name, t in tensors:
            slot = info.slots.get(name)
            if slot is None:
                raise P2PWriteError(
                    f"target {info.session_id} has no slot for {name!r}; its layout differs from the trainer's"
                )
            data = t.reshape(-1).view(torch.uint8)  # [nbytes]
            if data.numel() != slot.nbytes:
                raise P2PWriteError(
                    f"{name}: {data.numel()} bytes for a {slot.nbytes}-byte slot on {info.session_id} (layout mismatch)"
                )
            pipe.add(info.session_id, data, info.buffer_ptr + slot.offset, name)
        pipe.flush()  # the next target's bytes go to the other half while this write flies

    def _plan(self, targets: list[P2PTarget]) -> None:
        """Make `targets` (sorted by URL) the engine set and this source's share of it the plan."""
        self.all_targets = targets
        self.targets = [targets[i] for i in plan_transfers(self.num_sources, len(targets))[self.source_rank]]

    def follow(self, urls: list[str]) -> None:
        """Reach exactly these engines from the next update on: a joining engine's receive buffer and
        layout are fetched and the transfer plan is made again (every source computes the same plan
        from the same sorted URLs); an engine that left is dropped. Without a target factory (targets
        given by hand) a changed set is refused, naming the fix."""
        known = {t.url: t for t in self.all_targets}
        if sorted(urls) == sorted(known) and not self.stale:
            return
        if self.target_factory is None:
            fix = "give the transport a target_factory (http_target) to follow the engines, or use broadcast"
            refuse_change(self.name, list(known), urls, fix)
            return
        t0 = self.clock()
        refresh = self.stale
        targets = [known[u] if u in known and not refresh else self.target_factory(u) for u in sorted(urls)]
        joined, left = sorted(set(urls) - set(known)), sorted(set(known) - set(urls))
        self._plan(targets)
        self.stale = False
        self.replans += 1
        self.last_replan_s = self.clock() - t0
        log.info("p2p: re-planned for %d engines in %.3f s (joined %s, left %s%s)", len(targets),
                 self.last_replan_s, joined or "-", left or "-", "; target info refreshed" if refresh else "")  # fmt: skip

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> TransferReport:
        with self._lock, phases.measure(self.clock) as timer:
            try:
                report = self._push(named_tensors, version)
            except BaseException:
                self.stale = True  # fetch every engine's receive buffer again before the next update
                raise
        report.extra["update_weights_p2p_replans"] = float(self.replans)
        return timer.stamp(report)

    def _push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> TransferReport:
        checksums: list[dict[str, str]] = [{} for _ in self.targets]
        names: list[list[str]] = [[] for _ in self.targets]
        payload = 0
        pipe = _Pipe(self.staging, self._pool)
        try:
            # The next bucket is prepared while writes fly.
            for per_target in phases.timed(self._prepared(named_tensors), "bucket"):
                for i, (target, tensors) in enumerate(zip(self.targets, per_target, strict=True)):
                    with phases.phase("bucket"):
                        self._send(pipe, target, tensors)
                        for name, t in tensors:  # overlaps the write just submitted
                            names[i].append(name)
                            if self.verify:
                                checksums[i][name] = sb.checksum(sb.tensor_bytes(t))
                            payload += t.numel() * t.element_size()
        finally:
            pipe.drain()  # never leave a write reading staging; re-raises the first failed write
        for target, written, sums in zip(self.targets, names, checksums, strict=True):
            missing = sorted(set(target.info.slots) - set(written))
            if missing:
                raise P2PWriteError(
                    f"the update lacks {len(missing)} tensors {target.info.session_id} expects: {missing[:5]}"
                )
            with phases.phase("engine_load"):  # the target checks, copies into its weights, sets the version
                target.commit(P2PCommitRequest(version=version, names=written, checksums=sums))
        return TransferReport(
            version=version,
            transport=self.name,
            tensors=sum(map(len, names)),
            payload_bytes=payload,
            wire_bytes=payload,
            extra={"update_weights_wire_bytes": float(payload)},
        )

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.staging.close()


def http_target(engine_url: str, timeout_s: float = 300.0) -> P2PTarget:
    """A P2PTarget for an engine serving our extension (GET /p2p_receiver_info, POST /p2p_receiver_commit)."""
    import httpx

    base = engine_url.rstrip("/")
    auth = auth_headers()  # the job's key (LOCKSTEP_API_KEY): both routes need it when the engine has one
    resp = httpx.get(base + P2P_INFO_ROUTE, timeout=timeout_s, headers=auth)
    if resp.status_code != 200:
        raise P2PWriteError(f"{base}{P2P_INFO_ROUTE} answered {resp.status_code}: {resp.text[:300]}")
    info = P2PTargetInfo.model_validate(resp.json())

    def commit(req: P2PCommitRequest) -> None:
        r = httpx.post(
            base + P2P_COMMIT_ROUTE, json=req.model_dump(mode="json"), timeout=timeout_s, headers=auth
        )
        if r.status_code != 200:
            raise P2PWriteError(f"{base} refused the commit of version {req.version}: {r.text[:500]}")

    return P2PTarget(info=info, commit=commit, url=base)
