"""Bytes synced per step and update time: a LoRA adapter vs the full weights, to a real reference engine.

Why it exists: the point of LoRA sync (docs/lora.md) is that only the adapter moves after each step.
This measures, on one Qwen3-architecture model built offline (a random init, no download) and one
reference engine served over HTTP on 127.0.0.1 in this process:
- baseline: a full-weight update as `lockstep run` does it on one machine (transport auto: a full HF
  checkpoint written, the engine reloads it: lockstep.weights.from_disk), payload = every weight;
- LoRA: the adapter of the same model (rank r on every linear layer of the decoder) through
  AdapterSync, `disk` mode (auto: a peft directory, /load_lora_adapter) and `tensors` mode
  (broadcast: the tensors by value in /load_lora_adapter_from_tensors, sha256-checked by the engine).
Per variant: payload bytes, bytes on the wire / disk, and the median update time of --runs updates.
The ratio is full / LoRA for both bytes and time, measured in the same run.

Run: .venv/bin/python bench/lora_sync.py [--hidden 768 --layers 6 --vocab 32000 --rank 16 --runs 5]
     [--out bench/results --date 2026-12-04 --device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _model_dir(root: Path, hidden: int, layers: int, vocab: int) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(hidden // 256, 1),
        head_dim=64,
        vocab_size=vocab,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    d = root / "model"
    Qwen3ForCausalLM(cfg).save_pretrained(d)
    return d


def _time(update: Any, tensors: list[Any], runs: int, first_version: int) -> tuple[list[float], Any]:
    seconds, report = [], None
    for i in range(runs):
        t0 = time.perf_counter()
        report = update(tensors, first_version + i)
        seconds.append(time.perf_counter() - t0)
    return seconds, report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    p.add_argument("--device", default="cpu")
    args = p.parse_args()

    import torch
    from lockstep.driver.engines import start_reference_engine
    from lockstep.train.fsdp import FSDPBackend, FSDPConfig
    from lockstep.train.fsdp.lora import AdapterConfig
    from lockstep.weights.adapter import AdapterSync
    from lockstep.weights.from_disk import MODEL_FILES, FromDiskTransport

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="lora-sync-"))
    model = _model_dir(root, args.hidden, args.layers, args.vocab)
    server = start_reference_engine(model, max_lora_rank=args.rank)
    results: dict[str, Any] = {}
    try:
        full = FSDPBackend(FSDPConfig(model_path=model, device="cpu"))
        full_tensors = [(n, t.clone()) for n, t in full.export_weights()]
        full.close()
        disk = FromDiskTransport(root / "weights", [], config_dir=model, extra_files=MODEL_FILES)
        disk.follow([server.url])
        secs, rep = _time(disk.update_weights, full_tensors, args.runs, 1)
        disk.close()
        results["full (auto: from-disk)"] = {"payload": rep.payload_bytes, "wire": rep.wire_bytes, "s": secs}

        cfg = AdapterConfig(rank=args.rank, alpha=2 * args.rank, name="bench")
        lora = FSDPBackend(FSDPConfig(model_path=model, device="cpu", lora=cfg))
        adapter = [(n, t.clone() + 0.01) for n, t in lora.export_weights()]  # a trained (non-zero) adapter
        lora.close()
        for mode, label in (("disk", "LoRA (auto: peft dir)"), ("tensors", "LoRA (broadcast: tensors)")):
            sync = AdapterSync("bench", mode=mode, alpha=2 * args.rank, root=root / f"adapters-{mode}")  # type: ignore[arg-type]
            sync.follow([server.url])
            secs, rep = _time(sync.update_weights, adapter, args.runs, 1)
            sync.close()
            results[label] = {"payload": rep.payload_bytes, "wire": rep.wire_bytes, "s": secs}
    finally:
        server.stop()
    base = results["full (auto: from-disk)"]
    lines = [
        f"# LoRA sync vs full-weight sync ({args.date}, {args.device})",
        "",
        f"Qwen3-architecture model, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} "
        f"({base['payload'] / 4 / 1e6:.1f} M fp32 parameters), adapter rank {args.rank} on every linear "
        f"layer of the decoder; one reference engine on 127.0.0.1; median of {args.runs} updates each.",
        "Command: `python bench/lora_sync.py "
        + " ".join(
            f"--{k} {v}" for k, v in vars(args).items() if k in ("hidden", "layers", "vocab", "rank", "runs")
        )
        + "`",
        "",
        "| variant | payload bytes | wire/disk bytes | update s (median) | bytes ratio full/this | time ratio full/this |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, r in results.items():
        med = statistics.median(r["s"])
        lines.append(
            f"| {label} | {r['payload']:,} | {r['wire']:,} | {med:.4f} | "
            f"{base['payload'] / r['payload']:.1f}x | {statistics.median(base['s']) / med:.1f}x |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"lora_sync_{args.date}_{args.device}"
        stem.with_suffix(".md").write_text(text)
        stem.with_suffix(".json").write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
