"""The serialized_named_tensors format of /update_weights_from_tensor, and a restricted loader.

Why it exists: SGLang's /update_weights_from_tensor takes, per TP rank, base64 of
MultiprocessingSerializer output: a ForkingPickler pickle of [(name, tensor), ...] whose tensors
travel as shared-memory handles (CPU: a shared file descriptor or file name; CUDA: IPC handles), so
sender and engine must share the host. Unpickling bytes that arrived over HTTP is code execution,
so `loads_named_tensors` uses an unpickler that resolves only torch's tensor rebuild functions,
storage classes, dtypes and torch.Size/device, plus two checked rebuilds of its own: CPU storages
mapped by their /dev/shm name and CUDA IPC handles. Nothing in a payload can make the engine
connect anywhere (fd passing, which dials the sender's resource sharer, is refused); anything else
raises `UnsafePayload`. The engine enables the endpoint only with an explicit server flag.

Who calls it: lockstep.weights (the colocated CUDA-IPC transport) serializes; lockstep.engine loads.
"""

from __future__ import annotations

import base64
import collections
import io
import mmap
import os
import pickle
import re
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class UnsafePayload(pickle.UnpicklingError):
    """The payload references a global outside the allow-list (or is not [(name, tensor), ...])."""


SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"/torch_\d+_\d+_\d+")
"""The names torch gives shared-memory segments (at::NewProcessWideShmHandle)."""
_SHM_HEADER = 64
"""torch's RefcountedMapAllocator keeps its reference count in the segment's first 64 bytes (one
alignment unit); the storage's bytes follow."""


def _shm_name(handle: Any, what: str) -> str:
    name = handle.decode("ascii", "replace") if isinstance(handle, bytes) else str(handle)
    if not _SHM_NAME.fullmatch(name):
        raise UnsafePayload(f"{what} {name!r} is not a torch shared-memory name (/torch_<pid>_<n>_<n>)")
    return name


def _rebuild_shm(cls: Any, manager: Any, handle: Any, size: int, dtype: Any = None) -> Any:
    """Stands in for torch's rebuild_storage_filename: maps the segment by name, read-only copy on
    write, and never connects to the sender's `manager` socket (an address the sender picks)."""
    import torch

    path = SHM_DIR + _shm_name(handle, "shared-memory segment")
    nbytes = int(size) * (torch.empty((), dtype=dtype).element_size() if dtype is not None else 1)
    try:
        with open(path, "rb") as f:
            have = os.fstat(f.fileno()).st_size - _SHM_HEADER
            if not 0 <= nbytes <= have:
                raise UnsafePayload(
                    f"shared-memory segment {path} holds {have} bytes, the payload claims {nbytes}"
                )
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if nbytes else None
    except OSError as e:
        raise UnsafePayload(f"shared-memory segment {path}: {e}") from e
    if mapped is None:
        storage = torch.UntypedStorage(0)  # type: ignore[no-untyped-call]
    else:
        storage = torch.frombuffer(
            mapped, dtype=torch.uint8, count=nbytes, offset=_SHM_HEADER
        ).untyped_storage()
    if dtype is None:
        return storage
    return torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)  # type: ignore[no-untyped-call]


def _rebuild_cuda(*args: Any) -> Any:
    """torch's rebuild_cuda_tensor, once the ref-counter segment it maps is checked to be a torch
    shared-memory name (arg 11); CUDA IPC handles open no connection."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if len(args) != 15:
        raise UnsafePayload(f"rebuild_cuda_tensor takes 15 arguments, the payload has {len(args)}")
    if args[7] is not None and args[11] is not None:
        _shm_name(args[11], "CUDA ref-counter segment")
    return rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call]


def _storage_from_bytes(data: bytes) -> Any:
    """Stands in for torch.storage._load_from_bytes (a storage pickled by value: plain pickle of a CPU
    tensor, which crosses hosts): torch.load restricted to tensors and plain data."""
    import torch

    if not isinstance(data, bytes):
        raise UnsafePayload(f"a storage by value must be bytes, the payload has {type(data).__name__}")
    return torch.load(io.BytesIO(data), weights_only=True)


_SAFE_REBUILDS: dict[tuple[str, str], Any] = {
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _rebuild_shm,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
}
"""Rebuild functions replaced by checked versions of our own."""

_ALLOWED_FUNCS: dict[str, frozenset[str]] = {
    "torch.multiprocessing.reductions": frozenset(
        {"rebuild_tensor", "rebuild_storage_empty", "rebuild_typed_storage", "rebuild_typed_storage_child"}
    ),
    "torch._utils": frozenset({"_rebuild_tensor_v2"}),
}
"""Everything else the unpickler may resolve. Refused on purpose: rebuild_storage_fd and
multiprocessing's DupFd (the engine would dial the sender's resource-sharer address to fetch a file
descriptor: a sender-chosen connection that can hang it), rebuild_event, Parameter, containers."""


class _TensorOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in _SAFE_REBUILDS:
            return _SAFE_REBUILDS[(module, name)]
        if name in _ALLOWED_FUNCS.get(module, frozenset()):
            return super().find_class(module, name)
        if module == "torch" and name in ("Size", "device"):
            return getattr(torch, name)
        if module in ("torch", "torch.storage"):
            obj = getattr(torch if module == "torch" else torch.storage, name, None)
            if isinstance(obj, torch.dtype):
                return obj
            if isinstance(obj, type) and issubclass(obj, (torch.UntypedStorage, torch.storage.TypedStorage)):
                return obj
        if module == "torch" and name == "Tensor":
            return torch.Tensor
        if (module, name) == ("collections", "OrderedDict"):  # _rebuild_tensor_v2's empty hook dict
            return collections.OrderedDict
        raise UnsafePayload(f"serialized_named_tensors references {module}.{name}, which is not allowed")


_SHARING = threading.Lock()


def dumps_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """[(name, tensor)] -> base64 ForkingPickler bytes (SGLang's MultiprocessingSerializer output_str).

    The tensors are shared, not copied: keep them alive until the engine has loaded them. CPU
    tensors travel as named shared-memory segments (torch's file_system strategy, for this call
    only), the one CPU form the engine accepts; CUDA tensors as IPC handles.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp

    buf = io.BytesIO()
    with _SHARING:
        before = mp.get_sharing_strategy()  # type: ignore[no-untyped-call]
        mp.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
        try:
            ForkingPickler(buf).dump(list(named))
        finally:
            mp.set_sharing_strategy(before)  # type: ignore[no-untyped-call]
    return base64.b64encode(buf.getvalue()).decode("ascii")


def dumps_tensors_by_value(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """{name: tensor} -> base64 of a plain pickle whose CPU tensors carry their bytes (no shared memory),
    so the payload crosses hosts: what SGLang's /load_lora_adapter_from_tensors accepts from a trainer
    on another machine (its SafeUnpickler loads storages by value). Small tensors only (adapters):
    the bytes travel base64 in the JSON body."""
    data = {name: t.detach().to("cpu").contiguous() for name, t in named}
    return base64.b64encode(pickle.dumps(data, protocol=4)).decode("ascii")


def loads_named_tensors(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of dumps_named_tensors with the restricted unpickler; validates the structure."""
    import torch

    raw = base64.b64decode(payload) if isinstance(payload, str) else payload
    obj = _TensorOnlyUnpickler(io.BytesIO(raw)).load()
    if isinstance(obj, dict):
        obj = list(obj.items())
    if not isinstance(obj, list) or not all(
        isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], str) and isinstance(t[1], torch.Tensor)
        for t in obj
    ):
        raise UnsafePayload("serialized_named_tensors must decode to a list of (name, tensor) pairs")
    return obj
