"""The one-pass, multi-threaded delta encoder writes exactly what delta_codec defines.

Its frames must decode (delta_codec.decompress, the subscriber's own code) to the raw encoding
delta_codec.encode gives for the same bytes, its checksums must be st_bytes.checksum's, and the
counts and the new bytes must be exact, wherever the changed bytes fall relative to its chunks.
"""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.models import st_bytes as sb
from lockstep.weights import delta_codec as codec
from lockstep.weights.delta_encoder import TensorEncoder, encode_all


def pair(n: int, changed: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=n, dtype=np.uint8)
    new = base.copy()
    for i in changed:
        new[i] ^= 0x5A
    return base, new


CASES = {
    "unchanged": (1000, []),
    "first byte": (1000, [0]),
    "last byte": (1000, [999]),
    "chunk edges": (1000, [63, 64, 127, 640]),
    "late chunk only": (1000, [900, 901]),
    "dense": (1000, list(range(0, 1000, 3))),
    "empty": (0, []),
}


@pytest.mark.parametrize("encoding", codec.ENCODINGS)
@pytest.mark.parametrize("checksum", sb.CHECKSUM_ALGORITHMS)
@pytest.mark.parametrize("case", CASES)
def test_the_one_pass_output_is_the_codecs(encoding: codec.Encoding, checksum: str, case: str) -> None:
    n, changed = CASES[case]
    base, new = pair(n, changed)
    enc = TensorEncoder(encoding, checksum=checksum, chunk_bytes=64).encode(
        base, sb.checksum(base, checksum), new
    )
    assert enc.changed == codec.changed_bytes(base, new) == len(changed)
    assert enc.checksum == sb.checksum(new, checksum)
    if not changed:
        assert enc.frame is None and enc.new is None
        return
    assert enc.frame is not None and enc.new is not None
    raw = codec.encode(base, new, encoding)
    assert enc.raw_bytes == len(raw)
    assert codec.decompress(enc.frame, enc.raw_bytes) == raw  # the subscriber's decoder reads it
    assert np.array_equal(enc.new, new) and not np.shares_memory(enc.new, new)
    out = base.copy()
    codec.decode_into(out, raw, encoding)
    assert np.array_equal(out, new)


def test_a_damaged_frame_is_still_caught_by_the_frame_checksum() -> None:
    base, new = pair(4096, [5, 3000])
    enc = TensorEncoder("xor", chunk_bytes=512).encode(base, sb.checksum(base), new)
    assert enc.frame is not None
    bad = bytearray(enc.frame)
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(codec.CorruptDeltaError):
        codec.decompress(bytes(bad), enc.raw_bytes)


@pytest.mark.parametrize("workers", [1, 3])
def test_encode_all_keeps_input_order_and_computes_missing_base_checksums(workers: int) -> None:
    jobs = []
    for i in range(20):
        base, new = pair(3000 + i, [] if i % 4 == 0 else [i, 2000 + i], seed=i)
        out = np.empty_like(base) if i % 3 else None
        jobs.append(
            (f"t{i}", base, (lambda b=base: sb.checksum(b)) if i % 2 else sb.checksum(base), new, out)
        )
    got = list(encode_all(iter(jobs), workers=workers))
    assert [k for k, _ in got] == [f"t{i}" for i in range(20)]
    for (_, base, _, new, out), (_, enc) in zip(jobs, got, strict=True):
        assert enc.checksum == sb.checksum(new) and enc.changed == codec.changed_bytes(base, new)
        if enc.new is not None:
            assert np.array_equal(enc.new, new) and (out is None or enc.new is out)


def test_an_encoder_error_reaches_the_caller() -> None:
    base, _ = pair(10, [])
    with pytest.raises(ValueError, match="byte sizes differ"):
        list(encode_all([("a", base, "x", base[:5], None)], workers=2))
