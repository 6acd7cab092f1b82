"""The validation order for a low-precision recipe (§6), as five checks on this machine.

Why it exists: a recipe is trusted only after it is checked in this order, each step assuming the
previous one: (1) the shared quantizer is bit-exact between export and load, (2) the BF16
exceptions are the same at all four stages, (3) after a real weight update every engine tensor is
what the quantizer says it must be (the pre-flight with the quantization error allowed, the
quantizer's own only), (4) on the same sampled tokens the engine's logprobs match a trainer that
sees the served weights, and the gap to the full-precision trainer is measured, (5) the importance
ratio of those tokens is inside the job's mismatch bounds (every run reports it per step:
mismatch_ratio_*, train_rollout_kl in metrics.jsonl).

It runs the job's own model, recipe, reference engine (on the converted checkpoint) and trainer
backend; nothing is mocked. Who calls it: `lockstep precision-check` (lockstep.cli.precision_check).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lockstep.api import RLJob
from lockstep.config.driver import RunConfig, run_config
from lockstep.config.trainer import training_recipe
from lockstep.driver.engines import start_reference_engine
from lockstep.models import load_tokenizer, resolve_checkpoint
from lockstep.models.hub_data import resolve_data
from lockstep.numerics import quant
from lockstep.numerics.recipe import Recipe, convert_checkpoint
from lockstep.serving.client import EngineClient
from lockstep.serving.loop import LoopThread
from lockstep.serving.payloads import SamplingParams
from lockstep.tasks import load_task
from lockstep.train.common.mismatch import MismatchConfig, mismatch_metrics
from lockstep.train.common.packing import pack_sft
from lockstep.train.fsdp import FSDPBackend, FSDPConfig
from lockstep.weights.factory import build_transport
from lockstep.weights.preflight import check_weight_update_equal


@dataclass(slots=True)
class Check:
    """One step of the validation order."""

    step: int
    name: str
    passed: bool
    detail: str
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class _Ctx:
    config: RunConfig
    training: Recipe | None
    recipe: Recipe
    model_dir: Path
    work: Path
    weights: dict[str, torch.Tensor]
    served_dir: Path | None = None


def precision_check(job: RLJob, *, cache_dir: Path | None = None, samples: int = 8) -> list[Check]:
    """Run the five checks in order (a failed step still lets the later ones report)."""
    config, training = run_config(job), training_recipe(job)  # the manifest, read once
    recipe = config.serving or training
    if recipe is None:
        raise ValueError(
            "spec.rollout.precision and spec.trainer.precision are both bf16: there is no low-precision "
            "recipe to check; set spec.rollout.precision to fp8, mxfp8 or nvfp4"
        )
    model_dir = resolve_checkpoint(config.trainer.model.checkpoint, cache_dir=cache_dir)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    with tempfile.TemporaryDirectory(prefix="lockstep-precision-") as tmp:
        ctx = _Ctx(config, training, recipe, model_dir, Path(tmp), weights)
        checks = [_quantizer(ctx), _exceptions(ctx)]
        checks += _update_and_logprobs(ctx, samples)
    return checks


def _quantizer(ctx: _Ctx) -> Check:
    """(1) export -> safetensors -> load gives bit-identical dequantized weights."""
    s = ctx.recipe.scheme
    bad, n = [], 0
    for name, q in ctx.recipe.quantized(ctx.weights.items()):  # expert weights per expert
        if not isinstance(q, quant.Quantized):
            continue
        n += 1
        path = ctx.work / "q.safetensors"
        save_file(dict(quant.to_checkpoint(name, q)), str(path))
        back, _ = quant.from_checkpoint(name, load_file(str(path)), s)
        served = quant.dequantize(q)
        if back is None or not torch.equal(quant.dequantize(back), served):
            bad.append(f"{name}: load differs from export")
    detail = f"{n} tensors bit-exact from export to load ({s.format}, blocks {list(s.block)})"
    return Check(
        1, "shared quantizer", not bad and n > 0, "; ".join(bad[:5]) or detail, {"tensors": float(n)}
    )


def _exceptions(ctx: _Ctx) -> Check:
    """(2) the same tensors stay BF16 at conversion, training forward, export and engine load."""
    r = ctx.recipe
    shapes = [(n, tuple(t.shape)) for n, t in ctx.weights.items()]
    quantized = r.quantized_names(shapes)  # SGLang's names: expert weights per expert
    kept = r.ignored(shapes)
    ctx.served_dir = convert_checkpoint(ctx.model_dir, ctx.work / "served", r)  # stage 1
    config = json.loads((ctx.served_dir / "config.json").read_text())["quantization_config"]
    stage1 = set(config.get("ignored_layers", config.get("exclude_modules", [])))
    converted: dict[str, torch.Tensor] = {}
    for f in sorted(ctx.served_dir.glob("*.safetensors")):  # the conversion keeps the source's shards
        converted.update(load_file(str(f)))
    stage1_q = {
        n
        for n in quantized
        if n.removesuffix(".weight") + ".weight_scale_2" in converted
        or n.removesuffix(".weight") + ".weight_scale_inv" in converted
    }
    exported = {n for n, _ in r.export(ctx.weights.items())}
    stage3_q = {n for n in quantized if n in exported and n in converted and _has_scale(n, exported)}
    problems = []
    if stage1 != set(kept) or stage1_q != quantized:
        problems.append("conversion")
    if stage3_q != quantized:
        problems.append("export")
    train = ctx.training
    if train is not None and train != r:  # stage 2 exists when the trainer trains in the format
        problems.append("training forward (trainer.precision must equal rollout.precision)")
    reasons = sorted(
        {r.decide(n, s).reason for n, s in shapes if r.decide(n, s).reason != "not a linear weight"}
        - {"quantized"}
    )
    detail = f"{len(quantized)} quantized, {len(kept)} BF16 exceptions ({'; '.join(reasons) or 'none'})"
    return Check(2, "exception alignment", not problems, ("differs at " + ", ".join(problems)) if problems else detail,
                 {"quantized": float(len(quantized)), "exceptions": float(len(kept))})  # fmt: skip


def _has_scale(name: str, names: set[str]) -> bool:
    module = name.removesuffix(".weight")
    return any(f"{module}.{suffix}" in names for suffix in quant.SCALE_SUFFIXES)


def _update_and_logprobs(ctx: _Ctx, samples: int) -> list[Check]:
    """(3), (4), (5) against a live reference engine on the converted checkpoint."""
    config, served_dir = ctx.config, ctx.served_dir
    assert served_dir is not None
    on_cuda = config.trainer.transport.trainer_device.value == "cuda"
    device = "cuda" if on_cuda and torch.cuda.is_available() else "cpu"
    tiles = config.engines.true_on_policy
    server = start_reference_engine(served_dir, device=device, true_on_policy=tiles)
    io = LoopThread("precision-check")
    client = EngineClient(server.url)
    full = FSDPBackend(FSDPConfig(model_path=ctx.model_dir, device=device, true_on_policy=tiles,
                                  train_recipe=ctx.training))  # fmt: skip
    try:
        transport = build_transport(
            config.trainer.transport, ctx.work / "run", ctx.model_dir, [server.url], device
        )
        result = check_weight_update_equal([server.url], transport, full.export_weights,
                                           served=getattr(transport, "served", None))  # fmt: skip
        transport.close()
        step3 = Check(3, "per-tensor weight update", result.passed, result.message,
                      {"tensors": float(result.checked_tensors)})  # fmt: skip
        batch, rollout = _sample(ctx, io, client, samples)
        view = FSDPBackend(FSDPConfig(model_path=ctx.model_dir, device=device, true_on_policy=tiles,
                                      train_recipe=ctx.recipe))  # fmt: skip
        try:
            return [step3, *_compare(config, batch, rollout, full, view)]
        finally:
            view.close()
    finally:
        full.close()
        io.run(client.aclose())
        io.close()
        server.stop()


def _sample(ctx: _Ctx, io: LoopThread, client: EngineClient, samples: int) -> tuple[Any, torch.Tensor]:
    """`samples` completions of the job's prompts from the engine; the batch and the rollout logprobs."""
    model = ctx.config.trainer.model
    tok = load_tokenizer(ctx.model_dir, model.tokenizer, model.chat_template)
    data = resolve_data(ctx.config.trainer.data)
    task = load_task(data.prompts, data.eval_prompts, 0)
    max_new_tokens = ctx.config.settings.max_new_tokens
    pairs, lps = [], []
    for i in range(samples):
        prompt = tok.render(task.item(i, "train").messages, add_generation_prompt=True)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, sampling_seed=i)
        res = io.run(client.generate(prompt, params))
        pairs.append((prompt, list(res.output_ids)))
        lps.append(list(res.output_logprobs))
    batch = pack_sft(pairs, tok.pad_token_id)
    rollout = torch.zeros_like(batch.loss_mask)
    for row, lp in enumerate(lps):
        rollout[row, batch.loss_mask[row] > 0] = torch.tensor(lp, dtype=torch.float32)
    return batch, rollout


def _compare(
    config: RunConfig, batch: Any, rollout: torch.Tensor, full: FSDPBackend, view: FSDPBackend
) -> list[Check]:
    """(4) logprobs on the same tokens: the served-view trainer against the engine (the quantizer's
    values on both sides), the job's own trainer against it (the gap training sees); (5) the ratio."""
    mask = batch.loss_mask > 0
    exact_mode = config.engines.true_on_policy
    gap: Callable[[FSDPBackend], torch.Tensor] = lambda b: (b.compute_logprobs(batch) - rollout)[mask]  # noqa: E731
    d_view, d_full = gap(view), gap(full)
    view_max, full_mean = float(d_view.abs().max()), float(d_full.abs().mean())
    bound = 0.0 if exact_mode else (1e-3 if view.device_type == "cpu" else 0.05)  # kernel noise only
    step4 = Check(
        4,
        "logprobs on the same sampled tokens",
        view_max <= bound,
        f"served-view trainer vs engine: max |diff| {view_max:.3g} (bound {bound:g}); job's trainer vs engine: "
        f"mean |diff| {full_mean:.3g} over {int(mask.sum())} tokens",
        {"served_view_max_abs_diff": view_max, "train_rollout_logprob_abs_diff": full_mean},
    )
    mm = config.settings.trainer.loss.mismatch
    m = mismatch_metrics(
        d_full.double(), torch.ones_like(d_full), MismatchConfig(mode="off", low=mm.low, high=mm.high)
    )
    inside = m.get("mismatch_clipfrac", 0.0) <= 0.01
    step5 = Check(
        5,
        "importance ratio",
        inside,
        f"ratio mean {m.get('mismatch_ratio_mean', 1.0):.4f}, p99 {m.get('mismatch_ratio_p99', 1.0):.4f}, "
        f"outside [{mm.low}, {mm.high}]: {m.get('mismatch_clipfrac', 0.0):.2%}; monitored every step "
        "(metrics.jsonl: mismatch_ratio_*, mismatch_clipfrac, train_rollout_kl)",
        m,
    )
    return [step4, step5]
