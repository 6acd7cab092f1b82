"""Sharded loading of an HF checkpoint into FSDP2: each rank reads only the rows it owns.

Why it exists: loading the whole model on every rank before sharding it needs the whole checkpoint in
each rank's host memory (twice, transiently), so a model larger than one host cannot start at all,
and 8 ranks of a host each hold a full copy. Here the model is built with its parameters on the meta
device (buffers, e.g. the rotary tables, are computed as usual), sharded with `fully_shard`, given
empty storage for the local shards only, and every parameter's local rows are read straight from the
safetensors files by byte range (a row-major tensor's rows are one contiguous range), through one
reused staging buffer of at most `bucket_bytes`: peak host memory per rank is about the checkpoint
divided by the ranks (in the training dtype) plus one bucket. transformers' fused expert tensors
(`experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) are assembled from the checkpoint's
per-expert weights for the experts a rank owns. The result is bit-identical to the whole-model load
(runtime/tests/train/test_fsdp_sharded_load.py), with a test whose peak-memory bound the whole-model
load fails.

Who calls it: lockstep.train.fsdp.backend (when the checkpoint has weights and no LoRA adapter is
attached: the adapter is built on the loaded base).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lockstep.models import st_bytes as sb
from lockstep.numerics import experts

if TYPE_CHECKING:
    import torch

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
"""The staging buffer of one rank's reads."""

ST_TO_TORCH = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I16": "int16", "F16": "float16", "BF16": "bfloat16", "I32": "int32", "F32": "float32", "I64": "int64",
    "F64": "float64",
}  # fmt: skip
"""safetensors dtype name -> torch dtype attribute."""


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is created on the meta device; buffers stay where their
    module puts them (their values are computed, not loaded, so they must be real)."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def empty_model(path: Path, dtype: torch.dtype) -> Any:
    """The causal LM of checkpoint `path` with its parameters on the meta device (nothing read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]


def materialize(model: Any, device: torch.device) -> None:
    """Give every (sharded) parameter empty local storage on `device`, keeping the buffers' values."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if b.device.type != "meta"}
    model.to_empty(device=device)
    with _no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)


@contextlib.contextmanager
def _no_grad() -> Iterator[None]:
    import torch

    with torch.no_grad():
        yield


class ShardReader:
    """Reads row ranges of checkpoint tensors through one reused staging buffer."""

    def __init__(self, path: Path, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.entries = sb.checkpoint_entries(Path(path))
        """Every tensor of the checkpoint: file, dtype, shape, byte range."""
        self.bucket_bytes = bucket_bytes
        self._staging = np.empty(bucket_bytes, dtype=np.uint8)  # [bucket] reused for every read
        self.read_bytes = 0
        """Bytes read from the checkpoint so far."""
        self._files: dict[Path, Any] = {}

    def rows(self, name: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Copy rows [start, stop) of checkpoint tensor `name` into `out` (cast to its dtype)."""
        import torch

        entry = self.entries.get(name)
        if entry is None:
            raise KeyError(f"{name}: not in the checkpoint; it holds e.g. {sorted(self.entries)[:5]}")
        dtype = getattr(torch, ST_TO_TORCH[entry.dtype])
        row_elems = int(np.prod(entry.shape[1:], dtype=np.int64)) if len(entry.shape) > 1 else 1
        row_bytes = row_elems * sb.DTYPE_SIZES[entry.dtype]
        if row_bytes > self.bucket_bytes:
            raise ValueError(
                f"{name}: one row of {row_bytes} bytes exceeds the {self.bucket_bytes}-byte bucket"
            )
        flat = out.view(-1, row_elems) if row_elems > 1 else out.view(-1, 1)
        per = max(1, self.bucket_bytes // row_bytes)
        f = self._file(entry.file)
        for first in range(start, stop, per):
            last = min(first + per, stop)
            n = (last - first) * row_bytes
            view = memoryview(self._staging)[:n]  # type: ignore[arg-type]  # ndarray is a buffer
            got = os.preadv(f.fileno(), [view], entry.offset + first * row_bytes)
            if got != n:
                raise OSError(f"{entry.file}: short read of {name} ({got} of {n} bytes)")
            staged = torch.from_numpy(self._staging[:n]).view(dtype).view(last - first, row_elems)
            flat[first - start : last - start].copy_(staged)
            self.read_bytes += n

    def _file(self, path: Path) -> Any:
        if path not in self._files:
            self._files[path] = open(path, "rb")  # noqa: SIM115 - closed by close()
        return self._files[path]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def row_range(param: Any) -> tuple[int, int, Any]:
    """(first row, end row, local tensor) of a parameter's dim-0 shard on this rank (FSDP2 chunks
    dim 0 like torch.chunk); a plain tensor holds every row."""
    local = param.to_local() if hasattr(param, "to_local") else param
    full = int(param.shape[0]) if param.dim() else 1
    if not hasattr(param, "to_local"):
        return 0, full, local
    mesh = param.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    per = -(-full // world)
    start = min(rank * per, full)
    stop = min(start + per, full)
    if int(local.shape[0]) != stop - start:
        raise RuntimeError(f"unexpected shard: rows [{start}, {stop}) but a local shape {tuple(local.shape)}")
    return start, stop, local


def load_shards(model: Any, reader: ShardReader) -> int:
    """Read every parameter's and persistent buffer's local rows from the checkpoint; returns the
    number of tensors filled. A tied lm_head is filled once, through the embedding."""
    import torch

    done: set[int] = set()
    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if id(param) in done:
                continue
            done.add(id(param))
            start, stop, local = row_range(param)
            _fill(reader, name, start, stop, local)
            count += 1
        persistent = set(model.state_dict().keys())
        for name, buf in model.named_buffers():
            if name in persistent and name in reader.entries:
                reader.rows(name, 0, int(buf.shape[0]) if buf.dim() else 1, buf)
                count += 1
    return count


def _fill(reader: ShardReader, name: str, start: int, stop: int, local: torch.Tensor) -> None:
    if stop <= start:
        return
    if name in reader.entries or local.dim() != 3:
        reader.rows(name, start, stop, local)
        return
    x = experts.parse(name)
    if x is None or x.expert is not None:
        reader.rows(name, start, stop, local)  # raises naming the tensor
        return
    for e in range(start, stop):  # a fused expert tensor, assembled from the per-expert weights
        if x.proj == "gate_up_proj":
            half = local.shape[1] // 2
            gate, up = local[e - start, :half], local[e - start, half:]
            reader.rows(experts.per_expert_name(x.layer, e, "gate_proj"), 0, half, gate)
            reader.rows(experts.per_expert_name(x.layer, e, "up_proj"), 0, half, up)
        else:
            down = local[e - start]
            reader.rows(experts.per_expert_name(x.layer, e, "down_proj"), 0, down.shape[0], down)
