"""Engine-side receive of a broadcast update, per wire format, against one raw collective of the same bytes.

Why: bench/weights_broadcast.py finds the broadcast pipeline well above one raw collective of the same
bytes. This script isolates the collectives and the receiver's copies, without HTTP: two processes,
gloo on 127.0.0.1, the tensor shapes of a Qwen3-like model (--layers), the sender posting its
broadcasts asynchronously, the receiver either
  into-live:   one broadcast per tensor straight into its preallocated live tensor (what the engine does now);
  fresh+copy:  one broadcast per tensor into a fresh torch.empty, then copy_ into the live tensor
               (what the engine did before, and what SGLang's default path does);
  flattened:   SGLang's load_format="flattened_bucket": the sender concatenates the bucket's bytes
               (torch.cat), one broadcast, the receiver copies each slice into its live tensor;
  raw:         one broadcast of an already flat buffer of the same bytes, no copies (the physical floor).
Prints the median of --runs of each and its ratio to raw.

Run from the repository root:  .venv/bin/python bench/weights_broadcast_receive.py [--runs 6] [--layers 22]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lockstep.serving.weight_group import open_weight_update_group
from lockstep.weights.broadcast import free_port

MODES = ("into-live", "fresh+copy", "flattened", "raw")


def shapes(layers: int) -> list[tuple[int, ...]]:
    """embed + per layer (q, o, k, v, q_norm, k_norm, gate, up, down, 2 layer norms) + final norm."""
    layer = [(1024, 512), (512, 512), (256, 512), (256, 512), (64,), (64,)]
    layer += [(1536, 512), (1536, 512), (512, 1536), (512,), (512,)]
    return [(16384, 512), *(layer * layers), (512,)]


def _opts() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return opts


def receiver(port: int, mode: str, runs: int, layers: int) -> None:
    torch.set_num_threads(1)
    g = open_weight_update_group(
        backend="gloo", master_address="127.0.0.1", master_port=port, rank=1, world_size=2
    )
    live = [torch.empty(s) for s in shapes(layers)]
    flat = torch.empty(sum(p.numel() for p in live))
    for _ in range(runs + 1):
        if mode in ("flattened", "raw"):
            g.pg.broadcast([flat], _opts()).wait()
            off = 0
            for p in live if mode == "flattened" else []:
                p.view(-1).copy_(flat[off : off + p.numel()])
                off += p.numel()
            continue
        targets = [torch.empty(p.shape) if mode == "fresh+copy" else p for p in live]
        for w in [g.pg.broadcast([t], _opts()) for t in targets]:
            w.wait()
        if mode == "fresh+copy":
            for p, t in zip(live, targets, strict=True):
                p.copy_(t)
    g.close()


def sender_seconds(mode: str, runs: int, layers: int) -> float:
    port = free_port()
    proc = mp.get_context("spawn").Process(target=receiver, args=(port, mode, runs, layers))
    proc.start()
    g = open_weight_update_group(
        backend="gloo", master_address="127.0.0.1", master_port=port, rank=0, world_size=2
    )
    src = [torch.randn(s) for s in shapes(layers)]
    flat = torch.cat([t.view(-1) for t in src])
    times = []
    for _ in range(runs + 1):  # the first run opens connections: dropped
        t0 = time.perf_counter()
        if mode in ("flattened", "raw"):
            buf = torch.cat([t.view(-1) for t in src]) if mode == "flattened" else flat
            g.pg.broadcast([buf], _opts()).wait()
        else:
            for w in [g.pg.broadcast([t], _opts()) for t in src]:
                w.wait()
        times.append(time.perf_counter() - t0)
    proc.join(60)
    g.close()
    done = sorted(times[1:])
    return done[len(done) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--layers", type=int, default=22)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sh = shapes(args.layers)
    nbytes = sum(torch.Size(s).numel() * 4 for s in sh)
    secs = {m: sender_seconds(m, args.runs, args.layers) for m in MODES}
    print(
        f"{len(sh)} tensors, {nbytes / 2**20:.0f} MiB fp32, gloo over loopback, 2 processes, median of {args.runs}"
    )
    for m in MODES:
        print(f"{m:<11} {secs[m]:.3f} s  ratio to raw = {secs[m] / secs['raw']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
