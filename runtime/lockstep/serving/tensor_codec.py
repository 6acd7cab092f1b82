"""The serialized_named_tensors format of /update_weights_from_tensor, and a restricted loader.

Why it exists: SGLang's /update_weights_from_tensor takes, per TP rank, base64 of
MultiprocessingSerializer output: a ForkingPickler pickle of [(name, tensor), ...] whose tensors
travel as shared-memory handles (CPU: a shared file descriptor or file name; CUDA: IPC handles), so
sender and engine must share the host. Unpickling bytes that arrived over HTTP is code execution,
so `loads_named_tensors` uses an unpickler that resolves only torch's tensor and storage rebuild
functions, storage classes, dtypes, torch.Size/device and the fd hand-over class; anything else
raises `UnsafePayload`. The engine enables the endpoint only with an explicit server flag.

Who calls it: lockstep.weights (the colocated CUDA-IPC transport) serializes; lockstep.engine loads.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class UnsafePayload(pickle.UnpicklingError):
    """The payload references a global outside the allow-list (or is not [(name, tensor), ...])."""


_ALLOWED_FUNCS: dict[str, frozenset[str]] = {
    "torch.multiprocessing.reductions": frozenset(
        {
            "rebuild_tensor",
            "rebuild_storage_fd",
            "rebuild_storage_filename",
            "rebuild_storage_empty",
            "rebuild_cuda_tensor",
            "rebuild_typed_storage",
            "rebuild_typed_storage_child",
            "rebuild_event",
        }
    ),
    "torch._utils": frozenset({"_rebuild_tensor_v2", "_rebuild_parameter"}),
    "multiprocessing.resource_sharer": frozenset({"DupFd"}),
    "collections": frozenset({"OrderedDict"}),
    "torch.nn.parameter": frozenset({"Parameter"}),
}


class _TensorOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if name in _ALLOWED_FUNCS.get(module, frozenset()):
            return super().find_class(module, name)
        if module == "torch" and name in ("Size", "device", "Tensor"):
            return getattr(torch, name)
        if module in ("torch", "torch.storage"):
            obj = getattr(torch if module == "torch" else torch.storage, name, None)
            if isinstance(obj, torch.dtype):
                return obj
            if isinstance(obj, type) and issubclass(obj, (torch.UntypedStorage, torch.storage.TypedStorage)):
                return obj
        raise UnsafePayload(f"serialized_named_tensors references {module}.{name}, which is not allowed")


def dumps_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """[(name, tensor)] -> base64 ForkingPickler bytes (SGLang's MultiprocessingSerializer output_str).

    The tensors are shared, not copied: keep them alive until the engine has loaded them.
    """
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode("ascii")


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
