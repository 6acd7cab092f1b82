"""Raw tensor bytes of safetensors checkpoints, without torch: the canonical form the disk-delta diffs.

Why it exists: the disk-delta transport (§7.2.4) diffs the bytes of the canonical HF checkpoint,
not tensor values, so it needs each tensor's dtype, shape and exact byte range in each file. Reading
the safetensors header ourselves (8-byte little-endian length, then a JSON header with `dtype`,
`shape` and `data_offsets` per tensor) gives byte-exact, dtype-agnostic access (bf16 included) through
numpy memory maps. Also holds the durable-write helpers (flush + fsync + atomic rename) and the
checksums every transport and the pre-flight check use (xxh3-128 by default; blake3 and adler32 for
the disk-delta's `checksum` setting).

Who calls it: lockstep.weights (disk_delta.py, delta_encoder.py, p2p.py, preflight.py), the
`lockstep delta` CLI, lockstep.train.fsdp (sharded load and save) and the benchmarks. It lives with
the models because the trainer and the weight transports both read checkpoint files through it.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal, get_args

import numpy as np
import xxhash

if TYPE_CHECKING:
    import torch

CHECKSUM_FORMAT: Final = "xxh3-128"
"""The default checksum format (§7.2.4): fast, 128 bits, not cryptographic."""

ChecksumAlgorithm = Literal["xxh3-128", "blake3", "adler32"]
"""Checksums a delta index may record (lockstep.api Checksum): xxh3-128 (default), blake3 (a
cryptographic 256-bit hash, for stores shared with parties you do not trust), adler32 (32 bits,
cheapest, catches torn writes but not adversarial edits)."""

CHECKSUM_ALGORITHMS: tuple[str, ...] = get_args(ChecksumAlgorithm)

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
"""Bytes per element of each safetensors dtype name."""

TORCH_TO_ST = {
    "torch.bool": "BOOL", "torch.uint8": "U8", "torch.int8": "I8", "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e5m2": "F8_E5M2", "torch.int16": "I16", "torch.float16": "F16", "torch.bfloat16": "BF16",
    "torch.int32": "I32", "torch.float32": "F32", "torch.int64": "I64", "torch.float64": "F64",
}  # fmt: skip
"""torch dtype (as str) -> safetensors dtype name."""


def _byte_view(data: bytes | memoryview | np.ndarray) -> memoryview:
    return memoryview(data).cast("B")  # type: ignore[arg-type]  # ndarray exposes the buffer protocol


def _blake3(data: bytes | memoryview | np.ndarray) -> str:
    try:
        from blake3 import blake3
    except ImportError as e:  # the runtime extra installs it; a bare install may not have it
        raise RuntimeError(
            "checksum blake3 needs the `blake3` package: pip install 'lockstep[runtime]'"
        ) from e
    return str(blake3(_byte_view(data)).hexdigest())


def _adler32(data: bytes | memoryview | np.ndarray) -> str:
    return f"{zlib.adler32(_byte_view(data)):08x}"


_CHECKSUMS: dict[str, Callable[[bytes | memoryview | np.ndarray], str]] = {
    "xxh3-128": lambda d: xxhash.xxh3_128_hexdigest(d),  # type: ignore[arg-type]  # buffer protocol
    "blake3": _blake3,
    "adler32": _adler32,
}


def checksum(data: bytes | memoryview | np.ndarray, algorithm: str = CHECKSUM_FORMAT) -> str:
    """Checksum of raw bytes as lowercase hex: xxh3-128 (32 digits), blake3 (64) or adler32 (8)."""
    try:
        fn = _CHECKSUMS[algorithm]
    except KeyError:
        raise ValueError(f"checksum must be one of {CHECKSUM_ALGORITHMS}, got {algorithm!r}") from None
    return fn(data)


class Hasher:
    """A checksum fed piece by piece: `hexdigest()` equals `checksum(all pieces joined, algorithm)`."""

    __slots__ = ("_adler", "_h", "algorithm")

    def __init__(self, algorithm: str = CHECKSUM_FORMAT) -> None:
        if algorithm not in _CHECKSUMS:
            raise ValueError(f"checksum must be one of {CHECKSUM_ALGORITHMS}, got {algorithm!r}")
        self.algorithm = algorithm
        """The algorithm (one of CHECKSUM_ALGORITHMS)."""
        self._adler = 1
        self._h: object = None
        if algorithm == "xxh3-128":
            self._h = xxhash.xxh3_128()
        elif algorithm == "blake3":
            try:
                from blake3 import blake3
            except ImportError as e:
                raise RuntimeError(
                    "checksum blake3 needs the `blake3` package: pip install 'lockstep[runtime]'"
                ) from e
            self._h = blake3()

    def update(self, data: bytes | memoryview | np.ndarray) -> None:
        """Add the next piece."""
        if self._h is None:
            self._adler = zlib.adler32(_byte_view(data), self._adler)
        else:
            self._h.update(_byte_view(data))  # type: ignore[attr-defined]

    def hexdigest(self) -> str:
        """The checksum of every piece so far, as `checksum` writes it."""
        if self._h is None:
            return f"{self._adler:08x}"
        return str(self._h.hexdigest())  # type: ignore[attr-defined]


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The canonical bytes of a tensor (row-major, CPU), as a flat uint8 array without a copy when possible."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy()


def st_dtype(tensor: torch.Tensor) -> str:
    """The safetensors dtype name of a torch tensor."""
    try:
        return TORCH_TO_ST[str(tensor.dtype)]
    except KeyError:
        raise ValueError(f"dtype {tensor.dtype} has no safetensors name; convert the tensor first") from None


@dataclass(slots=True, frozen=True)
class TensorEntry:
    """Where one tensor lives in a safetensors file."""

    name: str
    """HF tensor name."""
    file: Path
    """The .safetensors file holding it."""
    dtype: str
    """safetensors dtype name (BF16, F32, ...)."""
    shape: tuple[int, ...]
    """Tensor shape."""
    offset: int
    """Absolute byte offset of the data in the file."""
    nbytes: int
    """Byte size of the data."""


def read_header(path: Path) -> tuple[dict[str, dict[str, object]], int]:
    """The JSON header of a safetensors file and the absolute offset where the data section starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        raw = f.read(n)
    if len(raw) != n:
        raise ValueError(f"{path}: truncated safetensors header ({len(raw)} of {n} bytes)")
    header: dict[str, dict[str, object]] = json.loads(raw)
    return header, 8 + n


def file_entries(path: Path) -> list[TensorEntry]:
    """Every tensor of one safetensors file, checking that its data lies inside the file."""
    header, base = read_header(path)
    size = path.stat().st_size
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        offsets: list[int] = meta["data_offsets"]  # type: ignore[assignment]
        start, end = int(offsets[0]), int(offsets[1])
        dtype = str(meta["dtype"])
        shape = tuple(int(d) for d in meta["shape"])  # type: ignore[attr-defined]
        if base + int(end) > size:
            raise ValueError(
                f"{path}: tensor {name!r} ends at byte {base + int(end)} past the file size {size}"
            )
        out.append(TensorEntry(name, path, dtype, shape, base + int(start), int(end) - int(start)))
    return out


def checkpoint_entries(directory: Path) -> dict[str, TensorEntry]:
    """Every tensor of a checkpoint directory (all *.safetensors files), by name."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors files; point at an HF checkpoint directory")
    out: dict[str, TensorEntry] = {}
    for f in files:
        for e in file_entries(f):
            if e.name in out:
                raise ValueError(
                    f"{directory}: tensor {e.name!r} is in both {out[e.name].file.name} and {f.name}"
                )
            out[e.name] = e
    return out


def read_entry(entry: TensorEntry) -> np.ndarray:
    """The tensor's bytes as a read-only uint8 memory map (no copy)."""
    if entry.nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(entry.file, dtype=np.uint8, mode="r", offset=entry.offset, shape=(entry.nbytes,))


def iter_checkpoint_bytes(directory: Path) -> Iterator[tuple[TensorEntry, np.ndarray]]:
    """(entry, bytes) for every tensor of a checkpoint, in name order."""
    entries = checkpoint_entries(directory)
    for name in sorted(entries):
        yield entries[name], read_entry(entries[name])


def fsync_dir(directory: Path) -> None:
    """fsync a directory so that the names in it (creations, renames, removals) are durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """fsync the bytes of file `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write a file so that it appears whole or not at all: temp file, flush, fsync, atomic rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_safetensors_bytes(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """Write a safetensors file from raw (dtype, shape, bytes) entries, durably (see write_durable)."""
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, _, data in tensors.values():
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
