"""Broadcast transport (the whole pipeline) against one raw collective of the same bytes, on gloo/CPU.

Why: the pipeline (buckets, per-bucket control message over HTTP, one collective per tensor, engine
load, version update, pause/continue) should add little on top of moving the bytes; the goal is at
most 10% overhead. Both measurements use two processes on 127.0.0.1 and gloo:
- pipeline: BroadcastTransport.push into a reference engine process (`lockstep engine`, fp32 CPU)
  holding a Qwen3-shaped model of about --mib MiB;
- raw: one broadcast of a flat buffer of the same byte count to a plain receiver process;
- per-tensor: the same tensors, one async broadcast each (SGLang's default wire format), received into
  preallocated tensors, no HTTP: the floor of the wire format, so pipeline / per-tensor is the
  pipeline's own overhead (HTTP control calls, bucketing, pause/continue, version) and
  per-tensor / raw is the cost of one collective per tensor (large on gloo over loopback).
Prints the best of --runs (the least disturbed run on a shared machine) of each and the ratios.

Run from the repository root:  .venv/bin/python bench/weights_broadcast.py [--mib 160] [--runs 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime" / "tests" / "weights"))

from lockstep.serving.weight_group import open_weight_update_group
from lockstep.weights.broadcast import BroadcastTransport, EngineTarget, free_port
from weights_subproc import EngineProcess

GOAL_OVERHEAD = 0.10


def write_model(directory: Path, mib: int) -> Any:
    from lockstep.models.tiny import save_tokenizer, tiny_config
    from transformers import Qwen3ForCausalLM

    layers = max(1, (mib - 32) // 13)  # ~13 MiB per layer below, 32 MiB of embeddings
    cfg = tiny_config(
        vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return model


def _broadcast_all(g: Any, tensors: list[torch.Tensor]) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    for w in [g.pg.broadcast([t], opts) for t in tensors]:
        w.wait()


def raw_receiver(port: int, shapes: list[list[int]], runs: int) -> None:
    g = open_weight_update_group(
        backend="gloo", master_address="127.0.0.1", master_port=port, rank=1, world_size=2
    )
    bufs = [torch.empty(s, dtype=torch.uint8) for s in shapes]
    for _ in range(runs + 1):
        _broadcast_all(g, bufs)
    g.close()


def raw_seconds(sizes: list[int], runs: int) -> float:
    """Best of `runs`: broadcasts of uint8 buffers of these sizes (one size: one raw collective)."""
    port = free_port()
    shapes = [[n] for n in sizes]
    p = mp.get_context("spawn").Process(target=raw_receiver, args=(port, shapes, runs))
    p.start()
    g = open_weight_update_group(
        backend="gloo", master_address="127.0.0.1", master_port=port, rank=0, world_size=2
    )
    bufs = [torch.ones(s, dtype=torch.uint8) for s in shapes]
    _broadcast_all(g, bufs)  # warm-up: connections
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        _broadcast_all(g, bufs)
        times.append(time.perf_counter() - t0)
    p.join(60)
    g.close()
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=160)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "model"
        model = write_model(d, args.mib)
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        engine = EngineProcess(d, device="cpu", extra=["--max-running-requests", "2"])
        try:
            transport = BroadcastTransport([EngineTarget(engine.url)], backend="gloo")
            transport.connect()
            times = []
            for v in range(1, args.runs + 2):
                t0 = time.perf_counter()
                transport.update_weights(named, version=v)
                times.append(time.perf_counter() - t0)
            transport.close()
        finally:
            engine.close()
    pipeline = min(times[1:])
    raw = raw_seconds([nbytes], args.runs)
    per_tensor = raw_seconds([t.numel() * t.element_size() for _, t in named], args.runs)
    overhead = pipeline / raw - 1
    print(f"{len(named)} tensors, {nbytes / 2**20:.0f} MiB, gloo over loopback, 2 processes")
    print(
        f"pipeline (BroadcastTransport.push into the engine): {pipeline:.3f} s  ({nbytes / pipeline / 1e9:.2f} GB/s)"
    )
    print(f"raw (one broadcast of the same bytes):              {raw:.3f} s  ({nbytes / raw / 1e9:.2f} GB/s)")
    print(f"per-tensor (one broadcast per tensor, no HTTP): {per_tensor:.3f} s")
    print(
        f"ratio pipeline / raw = {pipeline / raw:.3f} (overhead {overhead:+.1%}; goal <= {GOAL_OVERHEAD:.0%})"
    )
    print(f"ratio pipeline / per-tensor = {pipeline / per_tensor:.3f} (the pipeline's own overhead)")
    print(f"ratio per-tensor / raw = {per_tensor / raw:.3f} (the cost of one collective per tensor)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
