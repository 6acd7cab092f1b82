"""Engine-side receive of a broadcast update: into fresh tensors then copied, versus straight into the live weights.

Why: bench/weights_broadcast.py finds the broadcast pipeline about 2x slower than one raw collective
of the same bytes. The sender side is one async collective per tensor; the difference is on the
receiver: the reference engine (like SGLang) receives each tensor into a new allocation and then
copies it into the parameter (`load_weights`). This script isolates that: two processes, gloo on
127.0.0.1, the tensor shapes of a ~136 MiB Qwen3-like model, per-tensor broadcasts, the receiver either
(a) broadcasting straight into its preallocated live tensors, or (b) into a fresh torch.empty and then
copy_ into the live tensor. Prints the best of --runs of each and the ratio (b) / (a).

Run from the repository root:  .venv/bin/python bench/weights_broadcast_receive.py [--runs 6]
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

# embed + 8 layers of (3 MLP matrices, 4 attention matrices) + norms, fp32
SHAPES = [(16384, 512)] + [(1536, 512)] * 3 * 8 + [(512, 512)] * 4 * 8 + [(512,)] * 40


def receiver(port: int, mode: str, runs: int) -> None:
    torch.set_num_threads(1)
    g = open_weight_update_group(
        backend="gloo", master_address="127.0.0.1", master_port=port, rank=1, world_size=2
    )
    live = [torch.empty(s) for s in SHAPES]
    for _ in range(runs):
        for p in live:
            if mode == "fresh+copy":
                t = torch.empty(p.shape)
                g.broadcast(t)
                p.copy_(t)
            else:
                g.broadcast(p)


def sender_seconds(mode: str, runs: int) -> float:
    port = free_port()
    proc = mp.get_context("spawn").Process(target=receiver, args=(port, mode, runs))
    proc.start()
    g = open_weight_update_group(
        backend="gloo", master_address="127.0.0.1", master_port=port, rank=0, world_size=2
    )
    src = [torch.randn(s) for s in SHAPES]
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for w in [g.pg.broadcast([t], opts) for t in src]:
            w.wait()
        times.append(time.perf_counter() - t0)
    proc.join(60)
    return min(times[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    nbytes = sum(torch.Size(s).numel() * 4 for s in SHAPES)
    live = sender_seconds("into-live", args.runs)
    fresh = sender_seconds("fresh+copy", args.runs)
    print(f"{len(SHAPES)} tensors, {nbytes / 2**20:.0f} MiB fp32, gloo over loopback, 2 processes")
    print(f"receive straight into live weights: {live:.3f} s")
    print(f"receive into fresh tensors + copy:  {fresh:.3f} s")
    print(f"ratio fresh+copy / into-live = {fresh / live:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
