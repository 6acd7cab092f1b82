"""Streamed checkpoint writes of FSDP2 tensors: each rank writes its own rows, nothing is gathered.

Why it exists: a checkpoint in HF layout is one safetensors file of full tensors, and gathering them
first (the whole model, then the whole optimizer state, on rank 0) needs the whole model in one
host's memory: what sharded loading (sharded_load.py) avoids at start would come back at every save.
A row-major tensor's rows are one contiguous byte range of the file, so once rank 0 has written the
header (names, dtypes, shapes, offsets: known from the parameters' metadata alone), every rank writes
its own shard's rows at their offsets (pwrite) and the file is complete when the last rank is done:
peak host memory per rank stays at its shards. When the ranks do not share the directory (run dirs
on node-local volumes), rank 0 writes tensor by tensor as each is gathered, holding one full tensor
at a time. Either way the file appears under its final name only when whole (a temporary name,
fsync, rename after a barrier).

The optimizer state (AdamW's exp_avg and exp_avg_sq, the shape of their parameter) is written the
same way, `optimizer.safetensors` with `<param>.exp_avg` / `<param>.exp_avg_sq`, beside
`optimizer.json` (step counters and hyper-parameters), and read back per rank like the weights.

Who calls it: lockstep.train.fsdp.checkpoint.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lockstep.models import st_bytes as sb
from lockstep.train.fsdp.sharded_load import ShardReader, row_range

if TYPE_CHECKING:
    import torch

OPTIMIZER = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _header(layout: list[tuple[str, str, list[int], int]]) -> tuple[bytes, dict[str, int]]:
    """The safetensors header of `layout` (name, dtype, shape, bytes) and each tensor's file offset."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets, at = {}, 0
    for name, dtype, shape, nbytes in layout:
        meta[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + nbytes]}
        offsets[name] = at
        at += nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    base = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, {n: base + o for n, o in offsets.items()}


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes on the host ([n] uint8; a view when it already lives there)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _pwrite(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data)  # type: ignore[arg-type]  # ndarray is a buffer
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_sharded(tensors: Iterable[tuple[str, Any]], path: Path, rank: int) -> None:
    """Write `tensors` (name, DTensor or plain tensor: the same list on every rank) into safetensors
    file `path`: a collective of all ranks (see the module doc)."""
    import torch.distributed as dist

    named = list(tensors)
    layout = []
    for name, t in named:
        layout.append((name, sb.st_dtype(t), list(t.shape), t.numel() * t.element_size()))
    header, offsets = _header(layout)
    tmp = path.with_name(f".{path.name}.tmp-ranks")
    if rank == 0:
        with open(tmp, "wb") as f:
            f.write(header)
            f.truncate(len(header) + sum(n for *_, n in layout))
    if dist.is_initialized():
        dist.barrier()
    shared = _all_see(tmp.exists())
    fd = os.open(tmp, os.O_WRONLY) if (shared or rank == 0) else -1
    try:
        for name, t in named:
            if shared and hasattr(t, "to_local"):  # this rank's rows, where they belong
                start, _, local = row_range(t)
                row = t.element_size() * (int(np.prod(t.shape[1:], dtype=np.int64)) if t.dim() > 1 else 1)
                if local.numel():
                    _pwrite(fd, _host_bytes(local), offsets[name] + start * row)
            elif hasattr(t, "full_tensor") and not shared:  # gathered tensor by tensor to rank 0
                full = t.full_tensor()
                if rank == 0:
                    _pwrite(fd, _host_bytes(full), offsets[name])
                del full
            elif rank == 0:  # replicated (a buffer, an unsharded tensor)
                _pwrite(fd, _host_bytes(t), offsets[name])
        if fd >= 0:
            os.fsync(fd)
    finally:
        if fd >= 0:
            os.close(fd)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        os.replace(tmp, path)
        sb.fsync_dir(path.parent)


def _all_see(exists: bool) -> bool:
    """True when every rank sees rank 0's file (a directory shared by all ranks)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return exists
    flag = torch.tensor([1 if exists else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def save_optimizer(model: Any, optimizer: Any, directory: Path, rank: int) -> None:
    """AdamW's moments by parameter name (optimizer.safetensors) and its counters (optimizer.json)."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors, steps = [], {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            name = names[id(p)]
            tensors += [(f"{name}.{m}", state[m]) for m in MOMENTS]
            steps[name] = float(state["step"])
    write_sharded(tensors, directory / OPTIMIZER, rank)
    if rank == 0:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        meta = {"steps": steps, "param_groups": groups}
        tmp = directory / f".{OPTIMIZER_META}.tmp"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, directory / OPTIMIZER_META)


def load_optimizer(model: Any, optimizer: Any, directory: Path, bucket_bytes: int) -> None:
    """Restore what save_optimizer wrote: each rank reads its rows of every moment."""
    import torch

    meta = json.loads((directory / OPTIMIZER_META).read_text())
    params = dict(model.named_parameters())
    reader = ShardReader(directory, bucket_bytes)
    try:
        for name, step in meta["steps"].items():
            p = params[name]
            state: dict[str, Any] = {"step": torch.tensor(step, dtype=torch.float32)}
            for m in MOMENTS:
                moment = torch.zeros_like(p)
                start, stop, local = row_range(moment)
                with torch.no_grad():
                    if stop > start:
                        reader.rows(f"{name}.{m}", start, stop, local)
                state[m] = moment
            optimizer.state[p] = state
    finally:
        reader.close()
    for group, saved in zip(optimizer.param_groups, meta["param_groups"], strict=True):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})


def weights_of(model: Any, skip: Callable[[str], bool]) -> list[tuple[str, Any]]:
    """The model's state dict entries a checkpoint holds (a tied lm_head is left out by `skip`)."""
    return [(n, t) for n, t in model.state_dict().items() if not skip(n)]
