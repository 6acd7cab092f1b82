"""Disk-delta encode per core and across cores, and apply per core, against baselines of the same run.

Why: the disk-delta publisher runs on the trainer host while generation waits (sync) or goes on
(async); each core must keep up with the bytes of a version, and a trainer host has many cores. On bf16
tensors with 1% of elements changed by +-1 ulp (weights_delta_wire.py):

- encode = the publisher's whole inner loop per tensor: find the changed bytes, xor/overwrite encode,
  zstd level 1 with the frame checksum, the xxh3-128 of the new bytes for the index, and the copy kept
  as the next base. "one pass" is lockstep.weights.delta_encoder (what the publisher runs); "passes"
  is the same work as separate whole-tensor passes (the publisher before it), the baseline;
- scaling = delta_encoder.encode_all over 1, 2, ... N threads (N = the cores this process may use),
  wall GB/s and the ratio to one thread;
- apply = zstd decompress + decode into a copy of the base + xxh3-128 of the patched bytes (the
  subscriber's inner loop);
- baselines: memcpy of the same bytes and zstd level 1 of the raw (undiffed) bytes.

Per-core rates are bytes per second of the thread's own CPU time (time.thread_time): on a shared
machine the wall clock of one thread measures the other tenants; the wall clock is printed beside it.
Each figure is the best of --runs.

Run from the repository root:
  PYTHONPATH=runtime:bench .venv/bin/python bench/weights_delta_throughput.py [--mib 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from lockstep.models import st_bytes as sb
from lockstep.weights import delta_codec as codec
from lockstep.weights.delta_encoder import TensorEncoder, default_workers, encode_all

sys.path.insert(0, str(Path(__file__).parent))
from weights_delta_wire import model, ulp_step


def best(fn: Callable[[], object], runs: int) -> tuple[float, float]:
    """(best thread CPU seconds, best wall seconds) over `runs` runs."""
    cpu, wall = [], []
    for _ in range(runs):
        c0, w0 = time.thread_time(), time.perf_counter()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return min(cpu), min(wall)


def passes(bases: list[np.ndarray], news: list[np.ndarray], sums: list[str], enc: codec.Encoding) -> None:
    """The baseline: the same work as separate whole-tensor passes."""
    for b, n, base_sum in zip(bases, news, sums, strict=True):
        sb.checksum(n)
        if codec.changed_bytes(b, n):
            codec.compress(codec.encode(b, n, enc))
            assert base_sum  # the base checksum is known from the previous version
            np.array(n)


def one_pass(
    bases: list[np.ndarray],
    news: list[np.ndarray],
    sums: list[str],
    enc: codec.Encoding,
    outs: list[np.ndarray],
) -> None:
    encoder = TensorEncoder(enc)
    for b, n, s, o in zip(bases, news, sums, outs, strict=True):
        encoder.encode(b, s, n, o)  # the publisher's reused buffers (allocated once per run)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, help="also write the table to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base_sd = model(args.mib)
    new_sd = ulp_step(base_sd, 0.01, seed=1)
    bases = [np.array(sb.tensor_bytes(t)) for t in base_sd.values()]
    news = [np.array(sb.tensor_bytes(t)) for t in new_sd.values()]
    sums = [sb.checksum(b) for b in bases]
    gb = sum(b.size for b in bases) / 1e9
    lines = [
        f"# {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.uname().nodename}, load {os.getloadavg()[0]:.1f}, "
        f"{default_workers()} cores usable; {gb * 1e3 / 1.048576:.0f} MiB bf16, 1% of elements +-1 ulp",
        f"{'operation':>34} {'GB/s cpu':>9} {'GB/s wall':>10} {'vs baseline':>12}",
    ]
    dsts = [np.empty_like(b) for b in bases]
    rows: dict[str, tuple[float, float]] = {
        "memcpy": best(lambda: [np.copyto(d, b) for d, b in zip(dsts, bases, strict=True)], args.runs),
        "zstd-1 of the raw bytes": best(lambda: [codec.compress(b.tobytes()) for b in bases], args.runs),
    }
    ratios: dict[str, str] = {}
    for enc in codec.ENCODINGS:
        before = best(lambda enc=enc: passes(bases, news, sums, enc), args.runs)
        after = best(lambda enc=enc: one_pass(bases, news, sums, enc, dsts), args.runs)
        rows[f"encode {enc}, passes (baseline)"] = before
        rows[f"encode {enc}, one pass"] = after
        ratios[f"encode {enc}, one pass"] = f"{before[0] / after[0]:.2f}x cpu"
        frames = [TensorEncoder(enc).encode(b, s, n) for b, s, n in zip(bases, sums, news, strict=True)]

        def apply(enc: codec.Encoding = enc, frames: list = frames) -> None:
            for b, e in zip(bases, frames, strict=True):
                out = np.array(b)
                codec.decode_into(out, codec.decompress(e.frame, e.raw_bytes), enc)
                sb.checksum(out)

        rows[f"apply {enc}"] = best(apply, args.runs)
    # What a faster zstd level would buy (spec.weightSync.diskDelta.zstdLevel; level 1 is the default):
    fast = TensorEncoder("xor", level=-1)
    rows["encode xor, one pass, zstd -1"] = best(
        lambda: [fast.encode(b, s, n, o) for b, s, n, o in zip(bases, sums, news, dsts, strict=True)],
        args.runs,
    )
    size = {
        lvl: sum(
            len(TensorEncoder("xor", level=lvl).encode(b, s, n).frame or b"")
            for b, s, n in zip(bases, sums, news, strict=True)
        )
        for lvl in (1, -1)
    }
    ratios["encode xor, one pass, zstd -1"] = f"{size[-1] / size[1]:.2f}x bytes"
    for name, (cpu, wall) in rows.items():
        lines.append(f"{name:>34} {gb / cpu:>9.2f} {gb / wall:>10.2f} {ratios.get(name, '-'):>12}")
    lines.append("")
    lines.append(f"{'encode xor over threads':>34} {'GB/s wall':>10} {'vs 1 thread':>12}")
    counts = sorted({1, 2, default_workers()})
    jobs = list(zip(range(len(bases)), bases, sums, news, dsts, strict=True))
    one = None
    for w in counts:
        _, wall = best(lambda w=w: list(encode_all(jobs, workers=w)), args.runs)
        one = one or wall
        lines.append(f"{f'{w} threads':>34} {gb / wall:>10.2f} {one / wall:>11.2f}x")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
