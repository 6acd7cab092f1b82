"""CUDA IPC weight transport for colocated trainer and engine: handles travel, bytes stay on the GPU (seed §7.2).

Why it exists: when the trainer and the engine share GPUs, the cheapest hand-over is to let the engine
map the trainer's device memory. Per bucket the tensors are packed into one flat device buffer and
sent to /update_weights_from_tensor as views into it, so the engine opens one IPC handle per bucket
(what SGLang's flattened_bucket achieves) in the plain named-tensor format our engine's restricted
unpickler accepts. The version is set only after every bucket arrived. On CPU the same code shares
host memory, so the end-to-end test runs without a GPU; the measured path is CUDA. One engine, bound
at start: `follow` refuses any other set.

Who calls it: the trainer when the rollout pool is colocated; tests (gpu-marked) and bench/weights_ipc.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from lockstep.serving.client import EngineClient
from lockstep.serving.loop import LoopThread
from lockstep.serving.tensor_codec import dumps_named_tensors
from lockstep.weights.pipeline import Bucket, PipelineConfig, send_buckets
from lockstep.weights.transport import TransferReport, refuse_change

if TYPE_CHECKING:
    import torch


def flatten_bucket(
    bucket: Bucket, device: str | torch.device
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """Pack a bucket into one flat uint8 buffer on `device`; return it and (name, typed view) pairs.

    Each view starts at a 64-byte-aligned offset (so every dtype's view is aligned); the copy is
    device-to-device when the tensors already live on `device`.
    """
    import torch

    offsets, total = [], 0
    for _, t in bucket.named_tensors:
        total = (total + 63) // 64 * 64
        offsets.append(total)
        total += t.numel() * t.element_size()
    flat = torch.empty(max(total, 1), dtype=torch.uint8, device=device)  # [bucket bytes]
    views = []
    for (name, t), off in zip(bucket.named_tensors, offsets, strict=True):
        n = t.numel() * t.element_size()
        dst = flat[off : off + n]
        dst.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
        views.append((name, dst.view(t.dtype).view(t.shape)))
    return flat, views


class CudaIpcTransport:
    """WeightTransport for a colocated engine: one /update_weights_from_tensor call per bucket."""

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

    def send_bucket(self, bucket: Bucket) -> None:
        import torch

        flat, views = flatten_bucket(bucket, self.device)
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()  # the engine reads on its own stream
        payload = dumps_named_tensors(views)
        # Every TP rank of the engine maps the same bucket and takes its own slice when loading.
        self._io.run(
            self.client.update_weights_from_tensor([payload] * self.tp_size, flush_cache=False),
            self.timeout_s,
        )
        del views, flat  # the engine has copied the bucket: the storage may be freed now

    def follow(self, urls: list[str]) -> None:
        """One colocated engine, bound at start: any other engine set is refused, naming the fix."""
        fix = "cuda-ipc serves the one colocated engine of this trainer; restart the trainer with that engine"
        refuse_change(self.name, [self.client.base_url], urls, fix)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> TransferReport:
        t0 = self.clock()
        if self.pause_mode is not None:
            self._io.run(self.client.pause_generation(self.pause_mode), self.timeout_s)
        try:
            tensors, payload = send_buckets(named_tensors, self.config, self.send_bucket)
            self._io.run(self.client.flush_cache(), self.timeout_s)
            self._io.run(self.client.update_weight_version(version), self.timeout_s)
        finally:
            if self.pause_mode is not None:
                self._io.run(self.client.continue_generation(), self.timeout_s)
        return TransferReport(
            version=version,
            transport=self.name,
            tensors=tensors,
            payload_bytes=payload,
            wire_bytes=0,  # nothing crosses a wire: the engine maps the trainer's memory
            seconds=self.clock() - t0,
            extra={"update_weights_wire_bytes": 0.0},
        )

    def close(self) -> None:
        self._io.run(self.client.aclose())
        self._io.close()
