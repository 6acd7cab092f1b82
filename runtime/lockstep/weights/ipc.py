"""CUDA IPC weight transport for colocated trainer and engine: handles travel, bytes stay on the GPU (§7.2).

Why it exists: when the trainer and the engine share GPUs, the cheapest hand-over is to let the engine
map the trainer's device memory. Per bucket the tensors are packed into one flat device buffer and
sent to /update_weights_from_tensor as views into it, so the engine opens one IPC handle per bucket
(what SGLang's flattened_bucket achieves) in the plain named-tensor format our engine's restricted
unpickler accepts. Near the device's copy rate (docs/weights.md, "CUDA IPC near the copy rate"):
two flat buffers live as long as the transport (allocated once, so the engine maps the same two
allocations on every bucket of an update) and alternate, so the trainer packs bucket k+1 while the
engine loads bucket k; the pause travels while bucket 0 is packed; the last bucket carries the
version and the cache flush (no separate commit calls), so the version is set only after every
bucket arrived. On CPU the same code shares host memory, so the end-to-end test runs without a GPU;
the measured path is CUDA. One engine, bound at start: `follow` refuses any other set.

Who calls it: the trainer when the rollout pool is colocated; tests (gpu-marked) and bench/weights_ipc.py.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from lockstep.serving.client import EngineClient
from lockstep.serving.loop import LoopThread
from lockstep.serving.tensor_codec import dumps_named_tensors
from lockstep.weights import phases
from lockstep.weights.pipeline import Bucket, PipelineConfig, prepare_buckets
from lockstep.weights.transport import TransferReport, refuse_change

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

ALIGN = 64
"""Every view in a flat buffer starts at a multiple of this many bytes (so every dtype's view is aligned)."""


def bucket_layout(bucket: Bucket) -> tuple[list[int], int]:
    """Byte offset of each tensor of `bucket` in its flat buffer, and the buffer's size (pure)."""
    offsets, total = [], 0
    for _, t in bucket.named_tensors:
        total = (total + ALIGN - 1) // ALIGN * ALIGN
        offsets.append(total)
        total += t.numel() * t.element_size()
    return offsets, max(total, 1)


def pack_bucket(bucket: Bucket, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Copy a bucket's tensors into the uint8 buffer `flat` (one fused multi-tensor copy); return
    (name, typed view) pairs. `flat` must hold `bucket_layout(bucket)[1]` bytes."""
    import torch

    offsets, total = bucket_layout(bucket)
    if flat.numel() < total:
        raise ValueError(f"flat buffer holds {flat.numel()} bytes, the bucket needs {total}")
    views = []
    for (name, t), off in zip(bucket.named_tensors, offsets, strict=True):
        n = t.numel() * t.element_size()
        views.append((name, flat[off : off + n].view(t.dtype).view(t.shape)))
    if views:
        torch._foreach_copy_([v for _, v in views], [t.detach() for _, t in bucket.named_tensors])
    return views


def flatten_bucket(
    bucket: Bucket, device: str | torch.device
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """Pack a bucket into a new flat uint8 buffer on `device`; return it and (name, typed view) pairs."""
    import torch

    flat = torch.empty(bucket_layout(bucket)[1], dtype=torch.uint8, device=device)  # [bucket bytes]
    return flat, pack_bucket(bucket, flat)


def _with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """(item, whether it is the last) for every item, looking one ahead."""
    it = iter(items)
    try:
        item = next(it)
    except StopIteration:
        return
    for following in it:
        yield item, False
        item = following
    yield item, True


class FlatBuffers:
    """Two flat uint8 buffers on one device, alternating between buckets and kept across updates.

    A buffer is written again only two buckets later, after the engine answered for the bucket it
    held; it grows (never shrinks) when a bucket needs more. Keeping the allocations lets the
    engine map each one once per update instead of once per bucket.
    """

    def __init__(self, device: str | torch.device) -> None:
        self.device = device
        self._flat: list[Any] = [None, None]

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        """The buffer for bucket `index`, at least `nbytes` long."""
        import torch

        slot = index % 2
        flat: torch.Tensor | None = self._flat[slot]
        if flat is None or flat.numel() < nbytes:
            self._flat[slot] = None  # free the old one before allocating the larger one
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            if flat.device.type == "cpu":
                flat.share_memory_()  # type: ignore[no-untyped-call]  # once: the engine maps the same segment for every bucket
            self._flat[slot] = flat
        assert flat is not None
        return flat

    def allocations(self) -> list[int]:
        """The buffers' data pointers (0 for one not allocated yet)."""
        return [0 if f is None else int(f.data_ptr()) for f in self._flat]

    def release(self) -> None:
        self._flat = [None, None]


class CudaIpcTransport:
    """WeightTransport for a colocated engine: one /update_weights_from_tensor call per bucket,
    packing the next bucket while the engine loads this one."""

    name = "cuda-ipc"

    def __init__(
        self,
        engine_url: str,
        *,
        device: str = "cuda",
        tp_size: int = 1,
        config: PipelineConfig | None = None,
        pause_mode: str | None = "retract",
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 300.0,
    ) -> None:
        self.device = device
        self.tp_size = tp_size
        self.config = config or PipelineConfig()
        self.pause_mode = pause_mode
        self.clock = clock
        self.timeout_s = timeout_s
        self._io = LoopThread("ipc-io")
        self.client = EngineClient(engine_url, timeout_s=timeout_s)
        self.buffers = FlatBuffers(device)

    def _pack(self, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
        import torch

        with phases.phase("bucket"):
            flat = self.buffers.get(bucket.index, bucket_layout(bucket)[1])
            views = pack_bucket(bucket, flat)
            if flat.is_cuda:
                torch.cuda.current_stream(flat.device).synchronize()  # the engine reads on its own stream
        return views

    def _send(self, views: list[tuple[str, torch.Tensor]], version: int | None) -> Future[Any]:
        with phases.phase("transfer"):
            payload = dumps_named_tensors(views)  # IPC handles: the bytes stay where they are
            # Every TP rank of the engine maps the same bucket and takes its own slice when loading.
            call = self.client.update_weights_from_tensor(
                [payload] * self.tp_size, weight_version=version, flush_cache=version is not None
            )
            return self._io.submit(call)

    def _wait(self, pending: Future[Any] | None, what: str) -> None:
        if pending is not None:
            with phases.phase(what):
                pending.result(self.timeout_s)

    def _stream(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> tuple[int, int]:
        """Pause, send every bucket (the last one with the version), packing each while the engine
        loads the one before; (tensors, payload bytes) sent.

        One call is in flight at a time: bucket k is packed into the buffer of bucket k-2, which the
        engine answered for before bucket k-1 was sent. The last call (loading the last bucket and
        setting the version) is charged to `commit`."""
        pending = None
        if self.pause_mode is not None:
            with phases.phase("pause"):
                pending = self._io.submit(self.client.pause_generation(self.pause_mode))
        waiting = "pause"
        tensors = payload = 0
        try:
            buckets = phases.timed(prepare_buckets(named_tensors, self.config), "bucket")
            for bucket, last in _with_last(buckets):
                views = self._pack(bucket)  # while the engine loads the bucket before
                self._wait(pending, waiting)
                pending = self._send(views, version if last else None)
                waiting = "commit" if last else "engine_load"
                tensors += len(bucket.named_tensors)
                payload += bucket.nbytes
        except BaseException:
            if pending is not None:  # let the engine finish the call in flight before resuming it
                with phases.phase(waiting):
                    concurrent.futures.wait([pending], self.timeout_s)
            raise
        self._wait(pending, waiting)
        if waiting != "commit":  # no tensors at all: the version alone
            with phases.phase("commit"):
                self._io.run(self.client.flush_cache(), self.timeout_s)
                self._io.run(self.client.update_weight_version(version), self.timeout_s)
        return tensors, payload

    def follow(self, urls: list[str]) -> None:
        """One colocated engine, bound at start: any other engine set is refused, naming the fix."""
        fix = "cuda-ipc serves the one colocated engine of this trainer; restart the trainer with that engine"
        refuse_change(self.name, [self.client.base_url], urls, fix)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> TransferReport:
        with phases.measure(self.clock) as timer:
            try:
                tensors, payload = self._stream(named_tensors, version)
            finally:
                if self.pause_mode is not None:
                    with phases.phase("resume"):
                        self._io.run(self.client.continue_generation(), self.timeout_s)
        report = TransferReport(
            version=version,
            transport=self.name,
            tensors=tensors,
            payload_bytes=payload,
            wire_bytes=0,  # nothing crosses a wire: the engine maps the trainer's memory
            extra={"update_weights_wire_bytes": 0.0},
        )
        return timer.stamp(report)

    def close(self) -> None:
        self._io.run(self.client.aclose())
        self._io.close()
        self.buffers.release()
