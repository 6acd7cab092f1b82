"""CUDA IPC weight update of a 1.2 GB model on one GPU, against a device copy of the same bytes.

Why: the colocated transport (lockstep.weights.ipc) should cost little more than moving the bytes
on the device once. The engine runs as a separate process (`lockstep engine --device cuda`, bf16) on
the same GPU; the trainer holds a Qwen3-0.6B-shaped model (builtin "bigger", ~0.6B params, 1.2 GB in
bf16). Each update packs buckets of 512 MiB on the device, sends IPC handles through
/update_weights_from_tensor and the engine copies them into its weights. Baseline, measured in the
same run: one device-to-device copy of the same number of bytes (torch copy_, synchronized). Also
measures an update with no tensors (the HTTP control calls alone). Prints the median of N updates, GB/s, and the ratio update / device copy; writes JSON to --out.

Run on a CUDA machine from the repository root:
  PYTHONPATH=runtime:runtime/tests/weights python bench/weights_ipc.py --out bench/results/weights_ipc.json
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

from lockstep.models.tiny import materialize_builtin
from lockstep.weights import preflight
from lockstep.weights.ipc import CudaIpcTransport
from weights_subproc import EngineProcess


def device_copy_seconds(nbytes: int, runs: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = materialize_builtin("bigger", Path(tmp) / "bigger")
        engine = EngineProcess(
            model_dir, device="cuda", extra=["--dtype", "bfloat16", "--max-running-requests", "4"]
        )
        try:
            model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
            model = model.to("cuda")
            named = [(n, p.detach()) for n, p in model.named_parameters()]
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
            transport = CudaIpcTransport(engine.url, device="cuda")
            times = []
            for v in range(1, args.runs + 2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                transport.update_weights(named, version=v)
                times.append(time.perf_counter() - t0)
            times = times[1:]  # the first update opens the IPC mappings and warms the allocator
            # The control-plane floor: an update with no tensors (pause, flush, version, continue).
            floor = []
            for v in range(args.runs):
                t0 = time.perf_counter()
                transport.update_weights([], version=50 + v)
                floor.append(time.perf_counter() - t0)
            # Prove the last update delivered everything (checksums by name, on the engine).
            check = preflight.check_weight_update_equal(
                [engine.url],
                transport,
                lambda: named,
                version=100,
                trainer_checksums=True,
                compare_loaded=False,
            )
            transport.close()
        finally:
            engine.close()
    copy_s = device_copy_seconds(nbytes, args.runs)
    ipc_s = statistics.median(times)
    result = {
        "figure": "CUDA IPC weight update vs device copy of the same bytes",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "model": "builtin:bigger (Qwen3-0.6B shape, bf16)",
        "tensors": len(named),
        "bytes": nbytes,
        "ipc_update_s_median": ipc_s,
        "ipc_update_s_all": times,
        "ipc_update_GBps": nbytes / ipc_s / 1e9,
        "control_only_update_s_median": statistics.median(floor),
        "device_copy_s": copy_s,
        "device_copy_GBps": nbytes / copy_s / 1e9,
        "ratio_update_over_copy": ipc_s / copy_s,
        "all_tensors_equal_after_update": check.passed,
    }
    print(json.dumps(result, indent=2))
    print(
        f"ratio: CUDA IPC update {ipc_s * 1e3:.1f} ms / device copy {copy_s * 1e3:.2f} ms = {ipc_s / copy_s:.1f}x"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if check.passed else 1


if __name__ == "__main__":
    sys.exit(main())
