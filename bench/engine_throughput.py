"""Rollout tokens/s of the reference engine vs HF transformers generate() on the same model and prompts.

Why it exists: the figure "rollout tokens/s of the reference engine vs HF generate()" (goal
>= 5x) on an H200 with a ~0.6B random-init Qwen3-shaped model (lockstep.models.tiny.bigger_config).
Both run in the same process on the same weights, prompts, sampling settings (temperature 1, no
top-k/top-p, ignore eos, fixed output length) and each is warmed up once before its timed run. Also
printed: the ratio to a memory-bandwidth roofline measured in the same run (one decode step must at
least read all weights once; the bandwidth is measured by a device-to-device copy) and the
engine-vs-HF-forward logprob abs diff of the sampled tokens (bf16 numerics).

Run (GPU): PYTHONPATH=runtime python bench/engine_throughput.py --device cuda --out bench/results
Smoke (CPU, tiny model): PYTHONPATH=runtime python bench/engine_throughput.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import faulthandler
import json
import time
from pathlib import Path
from typing import Any

import torch
from lockstep.engine import ReferenceEngine
from lockstep.models.tiny import bigger_config, tiny_config
from lockstep.serving import SamplingParams
from transformers import Qwen3ForCausalLM


def _prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(10, vocab, (n_,), generator=g).tolist() for n_ in lens]


async def _engine_run(
    engine: ReferenceEngine, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list[Any]]:
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    seqs = [engine.new_sequence(p, sp) for p in prompts]
    sync(engine.device)
    t0 = time.perf_counter()
    done = await asyncio.wait_for(asyncio.gather(*(engine.submit(s) for s in seqs)), 300)
    sync(engine.device)
    return time.perf_counter() - t0, list(done)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hf_run(model: Any, prompts: list[list[int]], new_tokens: int, device: torch.device) -> tuple[float, int]:
    """HF generate() on the whole batch at once (left-padded), sampling, fixed length."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=0,
        )
    sync(device)
    return time.perf_counter() - t0, int((out.shape[1] - width) * out.shape[0])


def _bandwidth(device: torch.device) -> float:
    """Device memory bandwidth in bytes/s from a 1 GiB device-to-device copy (read + write)."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync(device)
    return 2 * 10 * a.numel() / (time.perf_counter() - t0)


def _logprob_diff(model: Any, done: list[Any], k: int) -> float:
    """Max |engine logprob - HF full-forward logprob| of sampled tokens over k sequences."""
    worst = 0.0
    with torch.inference_mode():
        for s in done[:k]:
            ids = torch.tensor([s.tokens], device=model.device)
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            ref = logp[s.prompt_len - 1 : -1].gather(1, ids[0, s.prompt_len :, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(s.logprobs, device=ref.device)).abs().max().item())
    return worst


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke run)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--out", default=None, help="dir for engine_throughput_<date>_<device>.json/.md")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(240, exit=True)  # a hang prints every thread's stack, then exits
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = tiny_config() if args.tiny else bigger_config()
    torch.manual_seed(0)
    with torch.device(device):
        model: Any = Qwen3ForCausalLM(cfg)
    model = model.to(dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    prompts = _prompts(args.prompts, 32, 128, cfg.vocab_size, seed=1)
    ctx = 128 + args.new_tokens + 1
    engine = ReferenceEngine(
        model,
        device=device,
        max_running_requests=args.prompts,
        context_length=ctx,
        cuda_graphs=device.type == "cuda" and not args.no_cuda_graphs,
    )
    await engine.start()
    await _engine_run(engine, prompts, args.new_tokens)  # warm-up: captures every graph bucket
    engine.flush_cache()  # timed run recomputes every prompt (no prefix reuse across runs)
    t_engine, done = await _engine_run(engine, prompts, args.new_tokens)
    n_engine = sum(len(s.output_ids) for s in done)
    diff = _logprob_diff(model, done, 4)
    await engine.close()
    _hf_run(model, prompts[:4], 8, device)  # warm-up
    t_hf, n_hf = _hf_run(model, prompts, args.new_tokens, device)
    bw = _bandwidth(device)
    weight_bytes = params * (2 if dtype == torch.bfloat16 else 4)
    roofline = args.prompts * bw / weight_bytes  # tokens/s if a step only read the weights once
    r = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": "tiny_config()" if args.tiny else "bigger_config() (Qwen3-0.6B-shaped, random init)",
        "params": params,
        "dtype": str(dtype),
        "prompts": args.prompts,
        "prompt_len": "uniform 32..128",
        "new_tokens": args.new_tokens,
        "cuda_graphs": engine.runner.cuda_graphs,
        "engine_tokens_per_s": n_engine / t_engine,
        "hf_generate_tokens_per_s": n_hf / t_hf,
        "ratio_engine_over_hf": (n_engine / t_engine) / (n_hf / t_hf),
        "bandwidth_GBps": bw / 1e9,
        "roofline_tokens_per_s": roofline,
        "engine_fraction_of_roofline": (n_engine / t_engine) / roofline if roofline == roofline else None,
        "engine_vs_hf_forward_max_abs_logprob_diff": diff,
        "command": "PYTHONPATH=runtime python bench/engine_throughput.py --device cuda --out bench/results",
    }
    print(json.dumps(r, indent=1))
    if args.out:
        tag = "h200" if "H200" in r["device"] else device.type
        base = Path(args.out) / f"engine_throughput_{r['date']}_{tag}"
        base.with_suffix(".json").write_text(json.dumps(r, indent=1) + "\n")
        md = [
            f"# Reference engine vs HF generate() ({r['device']}, {r['date']})",
            "",
            "| metric | value |",
            "|---|---|",
        ]
        md += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in r.items()]
        base.with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
