"""CUDA IPC weight update on one GPU at the Qwen3-0.6B and Qwen3-4B shapes, against a device copy of the same bytes.

Why: the colocated transport (lockstep.weights.ipc) should cost little more than moving the bytes on
the device once (goal: the update at >= 25% of the device copy's rate). The engine runs as a separate
process (`lockstep engine --device cuda`, bf16) on the same GPU; the trainer holds the same-shaped
model (random init, bf16) and updates it through CudaIpcTransport: per bucket one flat buffer (two
kept across updates, alternating), one IPC handle, the next bucket packed while the engine loads
this one, the version on the last bucket. Measured in the same run for each shape:

- the device copy baseline: one device-to-device copy of the update's bytes (torch copy_, synchronized);
- the transport at 512 MiB buckets (the default) and at larger buckets, median of N updates after a
  first one (which maps the buffers and warms the allocators), with the per-phase seconds of the
  median update (lockstep.weights.phases: where the time goes);
- "sequential": the transport's previous loop (a fresh flat buffer per bucket, each bucket waited for
  before the next is packed, separate flush and version calls), through the same engine;
- an update with no tensors (pause, version, continue: the HTTP floor).

The last update of each shape is checked by the pre-flight (the engine's checksums by name equal the
trainer's). Prints, per row, update / copy time and the update's rate as a percentage of the copy's.

Run on a CUDA machine from the repository root:
  PYTHONPATH=runtime:runtime/tests/weights python bench/weights_ipc.py --out bench/results/weights_ipc_DATE_h200.json
CPU smoke (the code path, no figure): ... --device cpu --shapes tiny --runs 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime" / "tests" / "weights"))

from lockstep.models.tiny import bigger_config, save_tokenizer, tiny_config
from lockstep.serving.tensor_codec import dumps_named_tensors
from lockstep.weights import phases, preflight
from lockstep.weights.ipc import CudaIpcTransport, flatten_bucket
from lockstep.weights.pipeline import PipelineConfig, prepare_buckets
from lockstep.weights.transport import TransferReport
from weights_subproc import EngineProcess

MIB = 1 << 20

SHAPES: dict[str, Any] = {
    "0.6b": lambda: bigger_config(),
    "4b": lambda: bigger_config(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "tiny": lambda: tiny_config(),
}
"""Qwen3-0.6B and Qwen3-4B shapes (tied embeddings, as both models ship), and tiny for the CPU smoke."""


def write_model(shape: str, directory: Path, device: str) -> Any:
    """A random-init bf16 model of `shape`, built on `device` and saved in HF layout; returns it."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(SHAPES[shape]()).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return model


def device_copy_seconds(nbytes: int, runs: int, device: str) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def sequential_update(transport: CudaIpcTransport, named: list[Any], version: int) -> TransferReport:
    """The previous loop, for comparison: a fresh flat buffer per bucket, waited for before the next
    is packed, then flush and version as their own calls."""
    io, client = transport._io, transport.client
    with phases.measure() as timer:
        with phases.phase("pause"):
            io.run(client.pause_generation("retract"))
        for bucket in prepare_buckets(named, transport.config):
            with phases.phase("bucket"):
                flat, views = flatten_bucket(bucket, transport.device)
                sync(transport.device)
            with phases.phase("engine_load"):
                io.run(client.update_weights_from_tensor([dumps_named_tensors(views)], flush_cache=False))
            del views, flat
        with phases.phase("commit"):
            io.run(client.flush_cache())
            io.run(client.update_weight_version(version))
        with phases.phase("resume"):
            io.run(client.continue_generation())
    return timer.stamp(TransferReport(version=version, transport="sequential"))


def timed_updates(update: Any, runs: int, first_version: int, device: str) -> dict[str, Any]:
    """First update, then `runs` more; the median's seconds and phases."""
    reports = []
    for i in range(runs + 1):
        sync(device)
        t0 = time.perf_counter()
        report = update(first_version + i)
        sync(device)
        reports.append((time.perf_counter() - t0, report))
    first, steady = reports[0], reports[1:]
    steady.sort(key=lambda r: r[0])
    secs, median = steady[len(steady) // 2]
    return {
        "first_s": first[0],
        "median_s": secs,
        "all_s": [r[0] for r in reports[1:]],
        "phases_of_median": {k: round(v, 6) for k, v in sorted(median.phases.items())},
    }


def bench_shape(shape: str, args: argparse.Namespace, version: list[int]) -> dict[str, Any]:
    device = args.device
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / shape
        model = write_model(shape, model_dir, device)
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        ntensors = len(named)
        engine = EngineProcess(
            model_dir, device=device, extra=["--dtype", "bfloat16", "--max-running-requests", "4"]
        )
        rows: dict[str, Any] = {}
        try:
            for mib in args.bucket_mib:
                transport = CudaIpcTransport(
                    engine.url, device=device, config=PipelineConfig(bucket_bytes=mib * MIB)
                )
                try:
                    rows[f"overlapped_{mib}MiB"] = timed_updates(
                        lambda v, t=transport: t.update_weights(named, version=v),
                        args.runs,
                        version[0],
                        device,
                    )
                    version[0] += args.runs + 1
                    if mib == args.bucket_mib[0]:
                        rows[f"sequential_{mib}MiB"] = timed_updates(
                            lambda v, t=transport: sequential_update(t, named, v),
                            args.runs,
                            version[0],
                            device,
                        )
                        version[0] += args.runs + 1
                        rows["control_only"] = timed_updates(
                            lambda v, t=transport: t.update_weights([], version=v),
                            args.runs,
                            version[0],
                            device,
                        )
                        version[0] += args.runs + 1
                finally:
                    transport.close()
            transport = CudaIpcTransport(
                engine.url, device=device, config=PipelineConfig(bucket_bytes=args.bucket_mib[0] * MIB)
            )
            try:  # every tensor arrived: the engine's checksums by name equal the trainer's
                check = preflight.check_weight_update_equal(
                    [engine.url], transport, lambda: named, version=version[0],
                    trainer_checksums=True, compare_loaded=False,
                )  # fmt: skip
                version[0] += 1
            finally:
                transport.close()
        finally:
            engine.close()
    model = named = None  # free the trainer copy before the baseline copy
    copy_s = device_copy_seconds(nbytes, max(args.runs, 5), device)
    out: dict[str, Any] = {
        "tensors": ntensors,
        "bytes": nbytes,
        "device_copy_s": copy_s,
        "device_copy_GBps": nbytes / copy_s / 1e9,
        "all_tensors_equal_after_update": check.passed,
        "preflight": check.message,
        "rows": rows,
    }
    for row in rows.values():
        row["GBps"] = nbytes / row["median_s"] / 1e9
        row["update_over_copy"] = row["median_s"] / copy_s
        row["pct_of_copy_rate"] = 100 * copy_s / row["median_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", nargs="+", default=["0.6b", "4b"], choices=sorted(SHAPES))
    ap.add_argument("--bucket-mib", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result: dict[str, Any] = {
        "figure": "CUDA IPC weight update vs device copy of the same bytes",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "shapes": {},
    }
    version = [1]
    ok = True
    for shape in args.shapes:
        r = bench_shape(shape, args, version)
        result["shapes"][shape] = r
        ok = ok and r["all_tensors_equal_after_update"]
        print(json.dumps({shape: r}, indent=1), flush=True)
        for name, row in r["rows"].items():
            print(
                f"{shape} {name}: {row['median_s'] * 1e3:.2f} ms (first {row['first_s'] * 1e3:.1f} ms) / "
                f"device copy {r['device_copy_s'] * 1e3:.3f} ms = {row['update_over_copy']:.1f}x, "
                f"{row['pct_of_copy_rate']:.1f}% of the copy rate",
                flush=True,
            )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
