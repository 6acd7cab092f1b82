"""Megatron backend on one GPU: memory and time of offload and optimizer streaming; export bandwidth.

Why it exists: the cost and saving of each memory mode of §7.1, measured. On a Qwen3-0.6B-shaped model (bigger_config, random
init, bf16 weights, fp32 master weights and Adam moments through megatron-core's distributed optimizer)
it trains the same batches with each memory mode and prints, per mode:

- resident GiB between steps (torch.cuda.memory_allocated while the trainer waits, after offload());
- peak GiB inside a train_step (max_memory_allocated);
- train_step seconds, offload and onload seconds, and the ratio of step time to the plain mode;
- whether the final weights equal the plain run's bit for bit (they must).

Then the weight export through the bucket pipeline (gather, HF conversion, buckets; export_weights) in
GB/s against a plain device-to-device copy of the same bytes measured in the same run.

Run (GPU):   PYTHONPATH=runtime python bench/megatron_memory.py --out bench/results
Smoke:       PYTHONPATH=runtime python bench/megatron_memory.py --tiny
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lockstep.models.tiny import bigger_config, tiny_config
from lockstep.train.common.batch import TrainBatch
from lockstep.train.common.losses import PolicyLossConfig, policy_loss

GIB = 1 << 30


def write_checkpoint(directory: Path, tiny: bool) -> Path:
    """A bf16 random-init HF checkpoint (config.json + model.safetensors) of the benchmark model."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = tiny_config() if tiny else bigger_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tied = config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    config.dtype = "bfloat16"
    config.save_pretrained(directory)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def make_batch(rows: int, length: int, vocab: int, seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (rows, length), generator=g)
    loss = torch.zeros(rows, length - 1)
    loss[:, length // 4 :] = 1.0
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones(rows, length, dtype=torch.long),
        loss_mask=loss,
        rollout_logprobs=torch.full((rows, length - 1), -3.0) * loss,
        advantages=torch.randn(rows, 1, generator=g).expand(rows, length - 1) * loss,
    )


def run_mode(
    path: Path, name: str, kw: dict[str, Any], batches: list[TrainBatch], mbs: int
) -> dict[str, Any]:
    from lockstep.train.megatron import MegatronConfig
    from lockstep.train.megatron.backend import MegatronBackend

    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated() / GIB
    backend = MegatronBackend(MegatronConfig(model_path=path, micro_batch_size=mbs, lr=1e-5, **kw))
    loss = partial(policy_loss, config=PolicyLossConfig())
    steps, peaks, resident, offs, ons = [], [], [], [], []
    try:
        for i, batch in enumerate(batches):
            t0 = time.perf_counter()
            backend.onload()
            torch.cuda.synchronize()
            ons.append(time.perf_counter() - t0)
            old = backend.compute_logprobs(batch)
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            backend.train_step(replace(batch, old_logprobs=old), loss)
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - t0)
            peaks.append(torch.cuda.max_memory_allocated() / GIB - base)
            if kw.get("offload", "none") != "none":
                t0 = time.perf_counter()
                backend.offload()
                offs.append(time.perf_counter() - t0)
            resident.append(torch.cuda.memory_allocated() / GIB - base)
            print(
                f"  {name} step {i + 1}: {steps[-1]:.3f} s, peak {peaks[-1]:.2f} GiB, resident {resident[-1]:.2f} GiB",
                flush=True,
            )
        weights = {k: v.detach().cpu().clone() for k, v in backend.export_weights()}
        streamed_peak = backend.streamed.peak_resident_bytes / GIB if backend.streamed else None
    finally:
        backend.close()
    return {
        "mode": name,
        "step_s": statistics.median(steps[1:] or steps),
        "peak_gib": max(peaks[1:] or peaks),
        "resident_between_steps_gib": resident[-1],
        "offload_s": statistics.median(offs[1:] or offs) if offs else None,
        "onload_s": statistics.median(ons[2:] or ons[1:]) if kw.get("offload", "none") != "none" else None,
        "streamed_moment_bucket_gib": streamed_peak,
        "_weights": weights,
    }


def export_bandwidth(path: Path, mbs: int) -> dict[str, float]:
    """export_weights GB/s vs one device-to-device copy of the same bytes."""
    from lockstep.train.megatron import MegatronConfig
    from lockstep.train.megatron.backend import MegatronBackend

    backend = MegatronBackend(MegatronConfig(model_path=path, micro_batch_size=mbs))
    try:
        times, nbytes = [], 0
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            nbytes = 0
            for _, t in backend.export_weights():
                nbytes += t.numel() * t.element_size()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copies = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            copies.append(time.perf_counter() - t0)
    finally:
        backend.close()
    export_s, copy_s = min(times[1:]), min(copies[1:])
    return {
        "export_bytes": nbytes,
        "export_s": export_s,
        "export_gb_s": nbytes / export_s / 1e9,
        "device_copy_gb_s": nbytes / copy_s / 1e9,
        "export_over_copy_time": export_s / copy_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="the tiny model (smoke run)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "model", args.tiny)
        vocab = 96 if args.tiny else 151936
        batches = [make_batch(args.rows, args.length, vocab, s) for s in range(args.steps)]
        modes = {
            "plain": {},
            "offload-cpu": {"offload": "cpu"},
            "offload-disk": {"offload": "disk", "state_dir": Path(tmp) / "off"},
            "streamed": {"stream_optimizer_state": True, "state_dir": Path(tmp) / "st"},
            "streamed+offload-cpu": {
                "stream_optimizer_state": True,
                "offload": "cpu",
                "state_dir": Path(tmp) / "st2",
            },
        }
        bandwidth = export_bandwidth(path, args.mbs)
        print(
            f"export_weights {bandwidth['export_gb_s']:.1f} GB/s, device copy {bandwidth['device_copy_gb_s']:.0f} GB/s",
            flush=True,
        )
        rows = []
        for name, kw in modes.items():
            rows.append(run_mode(path, name, kw, batches, args.mbs))
    plain_weights = rows[0].pop("_weights")
    for r in rows:
        w = r.pop("_weights", plain_weights)
        r["same_weights_as_plain"] = all(torch.equal(w[k], plain_weights[k]) for k in plain_weights)
        r["step_time_vs_plain"] = r["step_s"] / rows[0]["step_s"]
    device = torch.cuda.get_device_name()
    print(f"\nMegatron backend memory modes ({device}, {'tiny' if args.tiny else 'Qwen3-0.6B-shaped'}, "
          f"{args.rows}x{args.length} tokens/step, micro-batch {args.mbs}):")  # fmt: skip
    print(
        "| mode | resident between steps GiB | peak in step GiB | step s | x plain | offload s | onload s | same weights |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"| {r['mode']} | {r['resident_between_steps_gib']:.2f} | {r['peak_gib']:.2f} | {r['step_s']:.3f} | "
              f"{r['step_time_vs_plain']:.2f} | {fmt(r['offload_s'])} | {fmt(r['onload_s'])} | {r['same_weights_as_plain']} |")  # fmt: skip
    print(f"\nexport_weights: {bandwidth['export_bytes'] / 1e9:.2f} GB in {bandwidth['export_s']:.3f} s = "
          f"{bandwidth['export_gb_s']:.1f} GB/s; a device copy of the same bytes {bandwidth['device_copy_gb_s']:.0f} GB/s "
          f"({bandwidth['export_over_copy_time']:.0f}x the copy's time)")  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        day = datetime.date.today().isoformat()
        out = args.out / f"megatron_memory_{day}_{'tiny' if args.tiny else 'h200'}.json"
        out.write_text(
            json.dumps(
                {
                    "device": device,
                    "args": vars(args) | {"out": str(args.out)},
                    "modes": rows,
                    "export": bandwidth,
                },
                indent=1,
            )
        )
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
