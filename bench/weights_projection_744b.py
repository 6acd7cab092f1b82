"""Weight sync of a 744B MoE (GLM-5 shape) on the 64-GB300 layout of §9, projected transport by transport.

Why: no machine here holds 744B, but every phase of an update is either a byte count over a rate or a
fixed cost per call, and both are known: the per-call costs and the CPU codec rates are measured in
this run against the real reference engine and encoder; the link and memory rates are published
figures (/work/shared/notes/weight-sync-limits.md). Every input is printed with its value and source,
so the projection can be checked and re-run with other inputs (--set NAME=VALUE).

The layout (§9): 8 trainer nodes of 4 GB300 (32 ranks; Megatron TP2 x PP4, EP8: 4 pipeline stages,
each a source of its quarter of the model), 8 engine nodes of one 4-GPU SGLang engine each (every
engine holds the whole model over its 4 GPUs, about a quarter per GPU), all 64 GPUs in one NVL72
NVLink domain, one ConnectX-8 800G NIC per GPU, local NVMe on every node.

Per transport (phases as lockstep.weights.phases names them; the sum assumes no overlap between
phases, an upper bound for P2P, whose packing overlaps its writes):
- broadcast over NVLink (NCCL on the NVL72 domain) and over the NICs (no NVLink between the sides):
  every engine GPU receives every byte (P), the 4 stage sources gather their quarter over NVLink;
- p2p over the NICs (Mooncake RDMA; what the operator picks on RDMA nodes) and over NVLink (Mooncake's
  NVLink transport): each engine GPU receives only its quarter, 32 sources write in parallel;
- disk-delta: rank 0's host encodes the version (measured per-core rate x host cores), writes the
  compressed delta (1% of elements changed: the measured wire ratio) to shared storage; every engine
  node applies it to its NVMe copy and the engine reloads from NVMe (the only paused part).
cuda-ipc needs the trainer and the engine on the same GPUs, which §9's layout does not have.

Run from the repository root:
  PYTHONPATH=runtime:runtime/tests/weights .venv/bin/python bench/weights_projection_744b.py [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NOTES = "/work/shared/notes/weight-sync-limits.md"


@dataclass
class Input:
    value: float
    unit: str
    source: str


def published() -> dict[str, Input]:
    return {
        "params": Input(744e9, "parameters", "GLM-5 744B total (§9)"),
        "bytes_bf16": Input(744e9 * 2, "B", "BF16: 2 bytes per parameter"),
        "bytes_fp8": Input(0.77e12, "B", f"FP8 block-scaled with BF16 exceptions ~0.77 TB ({NOTES})"),
        "engine_tp": Input(4, "GPUs per engine", "§9: one 4-GPU engine per node"),
        "engines": Input(8, "engines", "§9: 8 generate nodes"),
        "trainer_ranks": Input(32, "ranks", "§9: 8 train nodes x 4 GPUs"),
        "stages": Input(4, "PP stages", "§9: TP2 x PP4 (one broadcast source per stage)"),
        "nvlink": Input(750e9, "B/s per GPU", f"NVLink5 NVL72, NCCL measured 750-811 GB/s ({NOTES})"),
        "nic": Input(96e9, "B/s per GPU", f"ConnectX-8 800G practical, one per GB300 ({NOTES})"),
        "hbm_copy": Input(
            8e12 * 0.85 / 2, "B/s", "GB300 HBM 8 TB/s x 0.85 (the H200 copy measured 85%) / 2 (read+write)"
        ),
        "nvme_read": Input(
            4 * 13e9, "B/s per node", f"4 Gen5 NVMe drives x 13 GB/s read ({NOTES}; 4 drives assumed)"
        ),
        "nvme_write": Input(4 * 10e9, "B/s per node", "4 Gen5 NVMe drives x 10 GB/s write (assumed)"),
        "shared_store": Input(25e9, "B/s", "shared storage write from rank 0's node (assumed: 2 x 100G)"),
        "host_cores": Input(144, "cores", "2 Grace CPUs x 72 cores per GB300 compute tray"),
        "bucket": Input(512 * 2**20, "B", "spec.weightSync.bucketMiB default (512 MiB)"),
        "wire_ratio_1pct": Input(
            71.7,
            "x",
            "disk-delta xor wire ratio at 1% of bf16 elements changed (bench/results/weights_delta_wire_*)",
        ),
        "miles_p2p": Input(8.48, "s", f"Miles P2P RDMA, GLM-5 744B on H100 ({NOTES})"),
        "prime_rl_pause": Input(5.2, "s", f"prime-rl pause, GLM-5.2 on H200 RDMA ({NOTES})"),
    }


def measured(runs: int) -> dict[str, Input]:
    """Per-call costs against the real reference engine over HTTP (loopback), and the CPU codec rates."""
    import numpy as np
    import torch
    from lockstep.models import st_bytes as sb
    from lockstep.models.tiny import materialize_builtin
    from lockstep.weights import delta_codec as codec
    from lockstep.weights.broadcast import BroadcastTransport, EngineTarget
    from lockstep.weights.delta_encoder import TensorEncoder
    from lockstep.weights.pipeline import PipelineConfig
    from safetensors.torch import load_file
    from weights_engine import EngineServer

    with tempfile.TemporaryDirectory() as tmp:
        tiny = materialize_builtin("tiny", Path(tmp) / "tiny")
        named = sorted(load_file(str(tiny / "model.safetensors")).items())
        server = EngineServer(tiny)
        transport = BroadcastTransport([EngineTarget(server.url)], config=PipelineConfig(bucket_bytes=1))
        try:
            per_bucket, pauses = [], []
            for v in range(1, runs + 1):  # every tensor its own bucket: the fixed cost of one bucket
                report = transport.update_weights(named, v)
                per_bucket.append(
                    (report.seconds - report.phases.get("pause", 0) - report.phases.get("resume", 0))
                    / len(named)
                )
                pauses.append(report.phases.get("pause", 0) + report.phases.get("resume", 0))
        finally:
            transport.close()
            server.close()
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(16, 1 << 20, generator=g) * 0.02).bfloat16()
    bits = base.clone().view(torch.int16).reshape(-1)
    idx = torch.randperm(bits.numel(), generator=g)[: bits.numel() // 100]
    bits[idx] += 1
    b, n = np.array(sb.tensor_bytes(base)), np.array(sb.tensor_bytes(bits))
    encoder, out = TensorEncoder("xor"), np.empty_like(b)
    enc_s, app_s = [], []
    for _ in range(runs):
        c = time.thread_time()
        e = encoder.encode(b, sb.checksum(b), n, out)
        enc_s.append(time.thread_time() - c)
        c = time.thread_time()
        patched = np.array(b)
        codec.decode_into(patched, codec.decompress(e.frame or b"", e.raw_bytes), "xor")
        sb.checksum(patched)
        app_s.append(time.thread_time() - c)
    return {
        "bucket_rtt": Input(
            statistics.median(per_bucket),
            "s per bucket",
            "measured here: a broadcast bucket's HTTP control + collective, reference engine on loopback",
        ),
        "pause_resume": Input(
            statistics.median(pauses), "s", "measured here: /pause_generation + /continue_generation"
        ),
        "encode_core": Input(
            b.size / min(enc_s),
            "B/s per core",
            "measured here: delta_encoder xor, 1% changed, thread CPU time",
        ),
        "apply_core": Input(
            b.size / min(app_s),
            "B/s per core",
            "measured here: zstd decompress + xor + xxh3, thread CPU time",
        ),
    }


def project(x: dict[str, float], payload: float) -> dict[str, dict[str, float]]:
    """Seconds per phase of one update, per transport (see the module doc)."""
    tp, engines, ranks, stages = x["engine_tp"], x["engines"], x["trainer_ranks"], x["stages"]
    quarter = payload / stages  # one stage's share, gathered by its source
    shard = payload / tp  # what one engine GPU holds
    buckets = payload / x["bucket"]
    quant = 0.0 if payload == x["bytes_bf16"] else (x["bytes_bf16"] / stages + quarter) / x["hbm_copy"]
    common = {"pause": x["pause_resume"] / 2, "resume": x["pause_resume"] / 2}
    out: dict[str, dict[str, float]] = {}
    for link in ("nvlink", "nic"):
        out[f"broadcast/{link}"] = {
            "gather": quarter / x["nvlink"], "quantize": quant,
            "transfer": payload / x[link],  # every byte reaches every engine GPU
            "engine_load": shard / x["hbm_copy"], "commit": buckets / stages * x["bucket_rtt"], **common,
        }  # fmt: skip
        per_source = engines * tp * shard / ranks  # 8 replicas of the model spread over 32 sources
        out[f"p2p/{link}"] = {
            "gather": per_source / x["nvlink"], "quantize": quant * stages * per_source / payload,
            "transfer": max(per_source, shard) / x[link], "engine_load": shard / x["hbm_copy"],
            "commit": engines * x["bucket_rtt"], **common,
        }  # fmt: skip
    wire = payload / x["wire_ratio_1pct"]
    out["disk-delta"] = {
        "gather": payload / x["nvlink"], "quantize": quant * stages,
        "encode": payload / (x["encode_core"] * x["host_cores"]), "transfer": wire / x["shared_store"],
        "patch": payload / (x["apply_core"] * x["host_cores"]) + payload / x["nvme_write"],
        "engine_load": payload / x["nvme_read"], **common,
    }  # fmt: skip
    return out


def paused_seconds(transport: str, ph: dict[str, float]) -> float:
    """What generation waits for: broadcast pauses around the whole send (the gathers run inside it);
    p2p writes into the engines' receive buffers while they generate and holds them only for the
    commit's copy; disk-delta pauses only for the reload from the patched local copy."""
    if transport.startswith("broadcast"):
        return sum(ph.values())
    if transport.startswith("p2p"):
        return ph["engine_load"] + ph["commit"]
    return ph["engine_load"] + ph["pause"] + ph["resume"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], help="NAME=VALUE: replace an input")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    inputs = {**published(), **measured(args.runs)}
    for item in args.set:
        name, value = item.split("=", 1)
        inputs[name] = Input(float(value), inputs[name].unit, "--set on the command line")
    x = {k: v.value for k, v in inputs.items()}
    lines = [
        f"# {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.uname().nodename} (device cpu), load {os.getloadavg()[0]:.1f}",
        "",
        "## inputs",
    ]
    lines += [f"{k:>17} = {v.value:.4g} {v.unit}  [{v.source}]" for k, v in inputs.items()]
    for label, payload in (("BF16", x["bytes_bf16"]), ("FP8", x["bytes_fp8"])):
        lines += [
            "",
            f"## {label}: {payload / 1e12:.2f} TB per version",
            f"{'transport':>18} {'total s':>8} {'paused s':>9} {'vs Miles 8.5 s':>15} {'vs prime-rl 5.2 s pause':>24}  phases (s)",
        ]
        for name, ph in project(x, payload).items():
            total = sum(ph.values())
            paused = paused_seconds(name, ph)
            parts = " ".join(
                f"{k}={v:.3g}" for k, v in sorted(ph.items(), key=lambda kv: -kv[1]) if v >= 1e-3
            )
            lines.append(
                f"{name:>18} {total:>8.2f} {paused:>9.2f} {total / x['miles_p2p']:>14.2f}x {paused / x['prime_rl_pause']:>23.2f}x  {parts}"
            )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
