"""Where the Megatron trainer's state lives between and inside steps (§7.1): offload and streaming.

Why it exists: a colocated trainer must give the GPU back while the engines generate, and a trainer
whose optimizer state is larger than its GPU must keep that state elsewhere. Two mechanisms:

- `Stash` (offload between steps, trainer.offload cpu|disk): a tensor's bytes go to pinned host memory
  or to a file on node-local disk and its device storage is resized to zero. Every view of it (the
  parameters are views into megatron-core's contiguous param buffer, the optimizer holds its own
  tensors) stays a valid object, so nothing has to be re-wired when the bytes come back. Gradient
  buffers hold nothing between steps: they are freed and re-zeroed (megatron-core's own
  offload_grad_buffers / restore_grad_buffers), never copied.
- `StreamedOptimizerState` (trainer.streamOptimizerStateToDisk): Adam's two moments (8 of the 12 bytes
  per parameter of optimizer state; the fp32 master weights stay on the GPU because megatron-core
  copies them into the bf16 weights right after the update) live in files on local disk. The inner
  torch optimizer's step runs bucket by bucket: load one bucket's moments, update those parameters,
  write the moments back, free them. Forward and backward never read them. Per-element Adam math is
  the same whatever the grouping, so a streamed run trains to the same bits as a resident one.

`optimizer_tensors` names every tensor of a megatron-core optimizer (master weights and moments) in a
fixed order: offload, streaming and checkpoints all walk that one list.

Who calls it: lockstep.train.megatron.backend and .checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

MOMENTS = ("exp_avg", "exp_avg_sq")
"""Adam state tensors that streaming keeps on disk."""


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside a megatron-core optimizer (a ChainedOptimizer holds several)."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [p.optimizer for p in parts if getattr(p, "optimizer", None) is not None]


def optimizer_params(optimizer: Any) -> Iterator[tuple[str, Any, Any]]:
    """(key, inner torch optimizer, master parameter) for every parameter the optimizer updates."""
    for i, inner in enumerate(inner_optimizers(optimizer)):
        for g, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                yield f"{i}.{g}.{j}", inner, p


def optimizer_tensors(
    optimizer: Any, *, moments: bool = True, master: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor): each master weight (`key.param`) and Adam moment (`key.exp_avg`, ...), fixed order."""
    for key, inner, p in optimizer_params(optimizer):
        if master:
            yield f"{key}.param", p.data
        if moments:
            state = inner.state.get(p, {})
            for name in MOMENTS:
                if name in state:
                    yield f"{key}.{name}", state[name]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of `t` (views with offsets included)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def resident(t: torch.Tensor) -> bool:
    """False when the tensor's storage was released (its bytes are stashed or streamed)."""
    return t.untyped_storage().nbytes() > 0


@dataclass(slots=True)
class Stash:
    """Device tensors moved to host memory or local disk, by key; their storage is freed meanwhile."""

    target: Literal["cpu", "disk"]
    """Pinned host memory, or files under `directory`."""
    directory: Path | None = None
    """Node-local directory of the files (target disk)."""
    _host: dict[str, torch.Tensor] = field(default_factory=dict)
    _sizes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.target == "disk":
            if self.directory is None:
                raise ValueError("a disk stash needs a directory on local disk")
            self.directory.mkdir(parents=True, exist_ok=True)

    def put(self, key: str, t: torch.Tensor) -> None:
        """Copy the storage of `t` away and release it (no-op when it is already released)."""
        if not resident(t):
            return
        flat = _flat(t)
        self._sizes[key] = flat.numel()
        if self.target == "cpu":
            host = self._host.get(key)
            if host is None or host.numel() != flat.numel():
                host = _pinned(flat.numel())
                self._host[key] = host
            host.copy_(flat, non_blocking=True)
        else:
            write_bytes(self._file(key), flat)
        _sync(t)
        t.untyped_storage().resize_(0)

    def take(self, key: str, t: torch.Tensor) -> None:
        """Re-allocate the storage of `t` and copy its bytes back (no-op when resident)."""
        if resident(t) or key not in self._sizes:
            return
        t.untyped_storage().resize_(self._sizes[key])
        flat = _flat(t)
        if self.target == "cpu":
            flat.copy_(self._host[key], non_blocking=True)
        else:
            flat.copy_(read_bytes(self._file(key)), non_blocking=False)

    def _file(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{key}.bin"


def _pinned(n: int) -> torch.Tensor:
    import torch

    return torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def _sync(t: torch.Tensor) -> None:
    import torch

    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def write_bytes(path: Path, flat: torch.Tensor) -> None:
    """Write a uint8 tensor's bytes to `path` (through host memory).

    A host tensor is copied first: numpy would pin its storage, which must stay resizable.
    """
    host = flat.cpu() if flat.is_cuda else flat.clone()
    host.numpy().tofile(path)


def read_bytes(path: Path) -> torch.Tensor:
    """A uint8 CPU tensor of the file's bytes."""
    import numpy as np
    import torch

    return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


@dataclass(slots=True)
class StreamedOptimizerState:
    """Adam moments on local disk, loaded bucket by bucket inside the optimizer step (see module doc)."""

    directory: Path
    """Node-local directory of the moment files."""
    bucket_bytes: int = 512 << 20
    """Moment bytes on the GPU at once (two fp32 tensors per parameter)."""
    stash: Stash = field(init=False)
    buckets_last_step: int = 0
    """How many buckets the last step streamed (metrics, tests)."""
    peak_resident_bytes: int = 0
    """Largest bucket of moments resident at once (since construction)."""
    _keys: dict[tuple[int, int], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stash = Stash("disk", self.directory)

    def install(self, optimizer: Any) -> None:
        """Make every inner torch optimizer of `optimizer` step bucket by bucket."""
        for inner in inner_optimizers(optimizer):
            for key, _, p in self._owner_keys(inner):
                self._keys[(id(inner), id(p))] = key
            inner.step = self._bucketed(inner, inner.step)

    def key_of(self, inner: Any, p: Any, name: str) -> str:
        """The file key of parameter p's moment `name` (p updated by the torch optimizer `inner`)."""
        return f"{self._keys[(id(inner), id(p))]}.{name}"

    def _bucketed(self, inner: Any, step: Any) -> Any:
        keys = {id(p): key for key, _, p in self._owner_keys(inner)}

        def streamed_step(closure: Any = None) -> Any:
            saved = [group["params"] for group in inner.param_groups]
            try:
                for bucket in self._plan(saved):
                    self._run_bucket(inner, step, saved, bucket, keys)
            finally:
                for group, params in zip(inner.param_groups, saved, strict=True):
                    group["params"] = params
            return None

        return streamed_step

    def _owner_keys(self, inner: Any) -> Iterator[tuple[str, Any, Any]]:
        for g, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                yield f"{id(inner)}.{g}.{j}", inner, p

    def _plan(self, groups: list[list[Any]]) -> list[set[int]]:
        """Buckets of parameter ids, each at most bucket_bytes of moments (a larger one alone)."""
        buckets: list[set[int]] = []
        current: set[int] = set()
        size = 0
        for params in groups:
            for p in params:
                n = 2 * p.numel() * 4
                if current and size + n > self.bucket_bytes:
                    buckets.append(current)
                    current, size = set(), 0
                current.add(id(p))
                size += n
        if current:
            buckets.append(current)
        return buckets

    def _run_bucket(
        self, inner: Any, step: Any, saved: list[list[Any]], bucket: set[int], keys: dict[int, str]
    ) -> None:
        chosen = [p for params in saved for p in params if id(p) in bucket]
        for p in chosen:
            self._load(inner, p, keys[id(p)])
        for group, params in zip(inner.param_groups, saved, strict=True):
            group["params"] = [p for p in params if id(p) in bucket]
        step()
        resident_bytes = 0
        for p in chosen:
            state = inner.state.get(p, {})
            for name in MOMENTS:
                if name in state:
                    resident_bytes += state[name].untyped_storage().nbytes()
                    self.stash.put(f"{keys[id(p)]}.{name}", state[name])
        self.peak_resident_bytes = max(self.peak_resident_bytes, resident_bytes)

    def _load(self, inner: Any, p: Any, key: str) -> None:
        state = inner.state.get(p, {})
        for name in MOMENTS:
            if name in state:
                self.stash.take(f"{key}.{name}", state[name])

    def read(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """The bytes of a streamed moment as a CPU tensor shaped like `t` (without touching the GPU)."""
        if resident(t):
            return t.detach().cpu()
        raw = read_bytes(self.stash._file(key))
        return raw.view(t.dtype).reshape(t.shape).clone()

    def write(self, key: str, t: torch.Tensor, value: torch.Tensor) -> None:
        """Replace a streamed moment's bytes (checkpoint load) and leave it on disk."""
        if not resident(t):
            t.untyped_storage().resize_(t.numel() * t.element_size())
        t.copy_(value.to(t.device, t.dtype))
        self.stash.put(key, t)
