"""Byte-level delta encodings of the disk-delta transport: xor and overwrite, then zstd (§7.2.4).

Why it exists: the disk-delta transport publishes only the bytes that changed between two versions of
the canonical checkpoint. The diff is over bytes, not tensor values (so it is dtype-agnostic and exact):

- xor (default): payload[i] = base[i] ^ new[i]. Unchanged bytes become 0x00 and compress to almost
  nothing. Applying it twice undoes it, so it must be applied exactly once (lineage is checked).
- overwrite: the changed byte positions (delta-coded, in the narrowest unsigned width that fits) and
  their new values. Larger for dense changes but idempotent: re-applying after a crash is safe.

Both are then compressed with Zstandard (level 1 by default, the spec's level). Pure functions on
numpy uint8 arrays; golden-tested; used by disk_delta.py and bench/weights_delta_*.py.
"""

from __future__ import annotations

import struct
from typing import Literal

import numpy as np
import zstandard

Encoding = Literal["xor", "overwrite"]
ENCODINGS: tuple[Encoding, ...] = ("xor", "overwrite")
DEFAULT_ZSTD_LEVEL = 1
"""zstd level of the spec (§7.2.4 / Miles): fast enough to keep up with the trainer."""

_OVERWRITE_HEADER = struct.Struct("<QB")  # number of changed bytes, width in bytes of each position delta
_WIDTHS = ((1, np.uint8), (2, np.uint16), (4, np.uint32), (8, np.uint64))


class CorruptDeltaError(ValueError):
    """A delta payload that cannot be decoded, or decodes to the wrong size."""


def changed_bytes(base: np.ndarray, new: np.ndarray) -> int:
    """How many bytes differ (the numerator of update_weights_density)."""
    _check_pair(base, new)
    return int(np.count_nonzero(base != new))


def _check_pair(base: np.ndarray, new: np.ndarray) -> None:
    if base.dtype != np.uint8 or new.dtype != np.uint8 or base.ndim != 1 or new.ndim != 1:
        raise TypeError("delta encodings work on flat uint8 byte arrays; pass st_bytes.tensor_bytes(...)")
    if base.size != new.size:
        raise ValueError(
            f"byte sizes differ ({base.size} vs {new.size}): name, dtype and shape must match the base"
        )


def encode(base: np.ndarray, new: np.ndarray, encoding: Encoding) -> bytes:
    """The raw (uncompressed) delta that turns `base` into `new`."""
    _check_pair(base, new)
    if encoding == "xor":
        xor: bytes = np.bitwise_xor(base, new).tobytes()
        return xor
    if encoding == "overwrite":
        return encode_positions(np.flatnonzero(base != new), new)
    raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")


def encode_positions(positions: np.ndarray, new: np.ndarray) -> bytes:
    """The overwrite delta of the changed byte `positions` ([K] ascending) holding `new`'s values."""
    deltas = np.diff(positions, prepend=0)  # small gaps compress far better than absolute offsets
    top = int(deltas.max()) if deltas.size else 0
    width, dt = next((w, d) for w, d in _WIDTHS if top < (1 << (8 * w)))
    body: bytes = deltas.astype(dt).tobytes() + new[positions].tobytes()
    return _OVERWRITE_HEADER.pack(positions.size, width) + body


def decode_into(out: np.ndarray, payload: bytes, encoding: Encoding) -> None:
    """Apply a raw delta in place: `out` holds the base bytes before and the new bytes after."""
    if encoding == "xor":
        if len(payload) != out.size:
            raise CorruptDeltaError(f"xor delta has {len(payload)} bytes, the tensor {out.size}")
        np.bitwise_xor(out, np.frombuffer(payload, dtype=np.uint8), out=out)
        return
    if encoding == "overwrite":
        if len(payload) < _OVERWRITE_HEADER.size:
            raise CorruptDeltaError("overwrite delta shorter than its header")
        count, width = _OVERWRITE_HEADER.unpack_from(payload)
        dt = dict(_WIDTHS).get(width)
        if dt is None or len(payload) != _OVERWRITE_HEADER.size + count * (width + 1):
            raise CorruptDeltaError(
                f"overwrite delta of {len(payload)} bytes does not hold {count} x {width}-byte deltas"
            )
        start = _OVERWRITE_HEADER.size
        deltas = np.frombuffer(payload, dtype=dt, count=count, offset=start).astype(np.int64)
        values = np.frombuffer(payload, dtype=np.uint8, count=count, offset=start + count * width)
        positions = np.cumsum(deltas)
        if count and (positions[-1] >= out.size or (deltas[1:] <= 0).any()):
            raise CorruptDeltaError("overwrite delta positions are out of range or not ascending")
        out[positions] = values
        return
    raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")


def compress(raw: bytes, level: int = DEFAULT_ZSTD_LEVEL) -> bytes:
    """zstd frame of `raw` with its content size and a frame checksum (so damage is caught on decode)."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True).compress(raw)


def decompress(frame: bytes, expected_size: int) -> bytes:
    """Inverse of compress; a damaged frame or a wrong size raises CorruptDeltaError."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=max(expected_size, 1))
    except zstandard.ZstdError as e:
        raise CorruptDeltaError(f"zstd frame does not decompress: {e}") from e
    if len(raw) != expected_size:
        raise CorruptDeltaError(f"zstd frame holds {len(raw)} bytes, the index says {expected_size}")
    return raw
