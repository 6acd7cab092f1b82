"""One FSDP2 rank that loads (or saves) a checkpoint and reports its peak host memory: run under torchrun.

Used by test_fsdp_sharded_load.py and bench/fsdp_sharded_load.py. The rank warms up the imports (a
one-layer model of the same class), resets the kernel's peak-RSS mark (/proc/self/clear_refs 5), builds
the FSDP2 backend from the checkpoint (`--mode sharded`: meta device + each rank's rows; `whole`: the
whole model first), reads VmHWM, and writes one JSON line per rank to `--out`: the peak RSS increase
in bytes, and the xxh3-128 of every full tensor (gathered tensor by tensor) so two loads can be
compared bit for bit. With `--save DIR` it then resets the mark again and saves the weights there,
reporting the save's peak too.

    torchrun --standalone --nproc-per-node 2 fsdp_load_rank.py --checkpoint DIR --mode sharded --out F
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def status_bytes(field: str) -> int:
    """A /proc/self/status memory line (VmHWM, VmRSS) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> int:
    """Reset the peak-RSS mark to the current RSS; returns the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_bytes("VmRSS")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--mode", choices=("sharded", "whole"), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--save", type=Path, default=None)
    ap.add_argument("--no-digest", action="store_true")
    args = ap.parse_args()
    import torch
    import xxhash
    from lockstep.train.fsdp import FSDPBackend, FSDPConfig
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    small = AutoConfig.from_pretrained(args.checkpoint)
    small.num_hidden_layers = 1
    AutoModelForCausalLM.from_config(small)  # the model class's imports and first allocations
    base = reset_peak()
    config = FSDPConfig(
        model_path=args.checkpoint, device="cpu", dtype="float32", sharded_load=args.mode == "sharded",
        load_bucket_bytes=args.bucket_mib << 20,
    )  # fmt: skip
    backend = FSDPBackend(config)
    peak = status_bytes("VmHWM") - base
    digests = {}
    if not args.no_digest:
        for name, value in backend.model.state_dict().items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            digests[name] = xxhash.xxh3_128_hexdigest(full.detach().contiguous().view(torch.uint8).numpy())
    record = {"rank": backend.rank, "world": backend.world_size, "peak_bytes": peak, "digests": digests}
    if args.save is not None:
        base = reset_peak()
        backend.save(args.save)
        record["save_peak_bytes"] = status_bytes("VmHWM") - base
    backend.close()
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
