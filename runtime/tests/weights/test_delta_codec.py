"""Golden tests of the byte-delta encodings (lockstep.weights.delta_codec)."""

from __future__ import annotations

import lockstep.weights.delta_codec as codec
import numpy as np
import pytest


def arrays() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, 10_000, dtype=np.uint8)
    new = base.copy()
    idx = rng.choice(base.size, 100, replace=False)
    new[idx] ^= rng.integers(1, 256, idx.size, dtype=np.uint8)
    return base, new


@pytest.mark.parametrize("encoding", codec.ENCODINGS)
def test_round_trip_and_compression(encoding: codec.Encoding) -> None:
    base, new = arrays()
    raw = codec.encode(base, new, encoding)
    frame = codec.compress(raw)
    assert len(frame) < base.size // 10  # 1% of bytes changed
    out = base.copy()
    codec.decode_into(out, codec.decompress(frame, len(raw)), encoding)
    assert np.array_equal(out, new)
    assert codec.changed_bytes(base, new) == 100


def test_xor_golden_and_not_idempotent_overwrite_idempotent() -> None:
    base = np.array([0x3C, 0x00, 0xFF], dtype=np.uint8)
    new = np.array([0x3D, 0x00, 0xFF], dtype=np.uint8)
    assert codec.encode(base, new, "xor") == bytes([0x01, 0x00, 0x00])
    raw = codec.encode(base, new, "overwrite")
    assert raw == (1).to_bytes(8, "little") + bytes([1]) + bytes([0]) + bytes([0x3D])
    twice = base.copy()
    codec.decode_into(twice, raw, "overwrite")
    codec.decode_into(twice, raw, "overwrite")
    assert np.array_equal(twice, new)
    x = codec.encode(base, new, "xor")
    twice = base.copy()
    codec.decode_into(twice, x, "xor")
    codec.decode_into(twice, x, "xor")
    assert np.array_equal(twice, base)  # why xor must be applied exactly once


def test_corrupt_payloads_raise() -> None:
    base, new = arrays()
    raw = codec.encode(base, new, "overwrite")
    with pytest.raises(codec.CorruptDeltaError):
        codec.decode_into(base.copy(), raw[:-1], "overwrite")
    frame = bytearray(codec.compress(raw))
    frame[len(frame) // 2] ^= 0xFF
    with pytest.raises(codec.CorruptDeltaError):
        codec.decompress(bytes(frame), len(raw))
    with pytest.raises(codec.CorruptDeltaError):
        codec.decode_into(base.copy(), codec.encode(base, new, "xor")[:-1], "xor")
    with pytest.raises(ValueError, match="byte sizes differ"):
        codec.encode(base, new[:-1], "xor")
