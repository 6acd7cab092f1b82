"""The disk-delta publisher's inner loop: one pass over each tensor, on every core (§7.2.4).

Why it exists: publishing a version means, for every tensor, finding the changed bytes, encoding
them (delta_codec: xor or overwrite), compressing the result with zstd, hashing the new bytes for the
index and keeping them as the next version's base. Done as separate whole-tensor passes (a boolean
`base != new`, an xor array, a compression, a hash, a copy), each pass streams the tensor through
memory again. `TensorEncoder` does it in one pass of cache-sized chunks: xor a chunk into a reused
buffer, count its non-zero bytes, feed it to a streaming zstd frame, hash the new chunk and copy it
into the next base, so the bytes are read from memory once. An unchanged tensor costs the xor and the
count only: its checksum is the base's, known from the previous version. The output is what
delta_codec writes (the same raw encodings inside one zstd frame with its content size and checksum),
so the published format and every subscriber check are unchanged.

`encode_all` spreads the tensors of a version over a pool of threads (numpy's loops and zstd release
the GIL), each with its own encoder, and returns the results in input order with a bounded number in
flight, so a trainer host's cores share the work and memory stays near `workers` tensors.

Who calls it: lockstep.weights.disk_delta.DeltaPublisher; bench/weights_delta_throughput.py.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import zstandard

from lockstep.models import st_bytes as sb
from lockstep.weights import delta_codec as codec

CHUNK_BYTES = 1 << 20
"""Bytes processed per step of the pass: small enough to stay in cache between the xor, the count,
the compressor, the hash and the copy (1 MiB measured fastest here: 256 KiB pays more calls, 4 MiB
falls out of cache)."""

K = TypeVar("K")


@dataclass(slots=True)
class Encoded:
    """One tensor of a version, encoded against its base."""

    changed: int
    """Bytes that differ from the base (the numerator of update_weights_density)."""
    checksum: str
    """Checksum of the new bytes (the index's `state`)."""
    raw_bytes: int = 0
    """Size of the uncompressed encoded delta (0 when unchanged)."""
    frame: bytes | None = None
    """zstd frame of the encoded delta; None when unchanged."""
    new: np.ndarray | None = None
    """Own copy of the new bytes (the next version's base); None when unchanged."""


class TensorEncoder:
    """Encodes tensors one at a time in one chunked pass; one per thread (zstd contexts are not
    thread-safe)."""

    def __init__(
        self,
        encoding: codec.Encoding = "xor",
        level: int = codec.DEFAULT_ZSTD_LEVEL,
        checksum: str = sb.CHECKSUM_FORMAT,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        if encoding not in codec.ENCODINGS:
            raise ValueError(f"encoding must be one of {codec.ENCODINGS}, got {encoding!r}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.encoding: codec.Encoding = encoding
        self.checksum = checksum
        self.chunk = chunk_bytes
        self._zstd = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
        self._xor = np.empty(chunk_bytes, dtype=np.uint8)  # [chunk] the xor of one chunk, reused
        self._zeros = np.zeros(chunk_bytes, dtype=np.uint8)

    def encode(
        self, base: np.ndarray, base_checksum: str, new: np.ndarray, out: np.ndarray | None = None
    ) -> Encoded:
        """Encode `new` ([n] uint8) against `base` ([n] uint8, the previous version, checksum known).

        `out` ([n] uint8, optional) receives the new bytes when the tensor changed: a buffer reused
        from version to version (a fresh one is allocated otherwise; its first touch faults every page
        in, which costs more than the whole encode)."""
        if base.dtype != np.uint8 or new.dtype != np.uint8 or base.ndim != 1 or new.ndim != 1:
            raise TypeError("delta encodings work on flat uint8 byte arrays; pass st_bytes.tensor_bytes(...)")
        if base.size != new.size:
            raise ValueError(
                f"byte sizes differ ({base.size} vs {new.size}): name, dtype and shape must match the base"
            )
        n, step = base.size, self.chunk
        if out is not None and (out.dtype != np.uint8 or out.shape != base.shape):
            raise ValueError(f"out must be a flat uint8 buffer of {n} bytes")
        spare, out = out, None  # `out`: the new bytes' own copy, from the first changed chunk on
        changed = 0
        hasher: sb.Hasher | None = None
        stream: zstandard.ZstdCompressionObj | None = None
        frames: list[bytes] = []
        positions: list[np.ndarray] = []  # overwrite: changed positions of each chunk
        for start in range(0, n, step):
            end = min(start + step, n)
            x = self._xor[: end - start]
            np.bitwise_xor(base[start:end], new[start:end], out=x)
            k = int(np.count_nonzero(x))
            if k and out is None:  # the first changed chunk: everything before it equals the base
                out = spare if spare is not None else np.empty(n, dtype=np.uint8)
                out[:start] = base[:start]
                hasher = sb.Hasher(self.checksum)
                hasher.update(new[:start])
                if self.encoding == "xor":
                    stream = self._zstd.compressobj(size=n)
                    for z in range(0, start, step):  # the unchanged prefix: zeros (zstd's RLE blocks)
                        frames.append(stream.compress(self._zeros[: min(step, start - z)]))  # type: ignore[arg-type]
            if out is None:
                continue
            assert hasher is not None
            changed += k
            if stream is not None:
                frames.append(stream.compress(x))  # type: ignore[arg-type]  # ndarray is a buffer
            elif k:
                positions.append(np.flatnonzero(x != 0) + start)  # nonzero() on bools: 10x uint8's
            hasher.update(new[start:end])
            np.copyto(out[start:end], new[start:end])
        if out is None or hasher is None:
            return Encoded(changed=0, checksum=base_checksum)
        if stream is not None:
            frames.append(stream.flush())
            return Encoded(changed, hasher.hexdigest(), n, b"".join(frames), out)
        raw = codec.encode_positions(np.concatenate(positions), out)
        return Encoded(changed, hasher.hexdigest(), len(raw), self._zstd.compress(raw), out)


def default_workers() -> int:
    """Threads of a publish: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def encode_all(
    jobs: Iterable[tuple[K, np.ndarray, str | Callable[[], str], np.ndarray, np.ndarray | None]],
    *,
    encoding: codec.Encoding = "xor",
    level: int = codec.DEFAULT_ZSTD_LEVEL,
    checksum: str = sb.CHECKSUM_FORMAT,
    workers: int | None = None,
) -> Iterator[tuple[K, Encoded]]:
    """(key, Encoded) for every (key, base, base checksum, new, out) job, in input order.

    The base checksum may be a callable (computed on the worker when the previous version did not
    record it). With workers > 1 the jobs run on that many threads, at most 2 x workers in flight;
    the jobs iterable itself (the trainer's export) is pulled on the calling thread.
    """
    workers = workers or default_workers()
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")

    def make() -> TensorEncoder:
        return TensorEncoder(encoding, level, checksum)

    if workers == 1:
        encoder = make()
        for key, base, base_sum, new, out in jobs:
            yield key, encoder.encode(base, base_sum() if callable(base_sum) else base_sum, new, out)
        return
    import threading

    local = threading.local()

    def run(
        base: np.ndarray, base_sum: str | Callable[[], str], new: np.ndarray, out: np.ndarray | None
    ) -> Encoded:
        encoder = getattr(local, "encoder", None)
        if encoder is None:
            encoder = local.encoder = make()
        return encoder.encode(base, base_sum() if callable(base_sum) else base_sum, new, out)

    pending: deque[tuple[K, Future[Encoded]]] = deque()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="delta-encode") as pool:
        try:
            for key, base, base_sum, new, out in jobs:
                pending.append((key, pool.submit(run, base, base_sum, new, out)))
                while len(pending) >= 2 * workers:
                    done_key, fut = pending.popleft()
                    yield done_key, fut.result()
            while pending:
                done_key, fut = pending.popleft()
                yield done_key, fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()
