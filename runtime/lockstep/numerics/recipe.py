"""The low-precision recipe: which tensors are quantized, declared once, applied at all four stages.

Why it exists: seed §6 makes low precision a contract over four stages (1 checkpoint conversion,
2 training forward, 3 online export, 4 rollout); an exception honoured at one stage only breaks it.
So one `Recipe` (the format from spec.rollout.precision, the BF16 exceptions from
spec.model.bf16Modules) decides, by tensor name and shape, and every stage asks it:
1. `convert_checkpoint` writes the serving checkpoint (SGLang layout, `quantization_config` with
   the exceptions as ignored layers);
2. `install_training` makes the trainer's linear layers see `fake_quantize(w)` (straight-through
   gradient) when the trainer trains in the same format;
3. `export` turns each pushed (name, tensor) into what the engine loads;
4. `receive` (engine side) dequantizes exactly what arrived with scales, nothing else.
`served` is what an engine holds after stage 4, computed on the trainer side: the pre-flight
compares checksums against it (the quantization error is allowed, but only the quantizer's own).

What is quantized: 2-D linear layer weights (`*_proj.weight`, MLA's `kv_a_proj_with_mqa`, the DSA
indexer's `wq_b` / `wk`: LINEAR); embeddings, norms, routers and lm_head stay in the checkpoint dtype,
as in SGLang's FP8 checkpoints, and so do routed experts (ROUTED_EXPERT) and the linear layers SGLang
builds unquantized (UNQUANTIZED). A projection is an exception when a bf16Modules pattern matches its module name
(fnmatch) or that of a projection SGLang fuses it with (q/k/v, gate/up: FUSED_SHARDS), or when its
contraction axis is not a whole number of blocks (MXFP8: 32, NVFP4: 16).

Who calls it: lockstep.weights.quantizing (3), lockstep.engine (4), lockstep.train.fsdp (2),
lockstep.driver (1), `lockstep precision-check`.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lockstep.api import Precision, RLJob
from lockstep.numerics import exact, quant
from lockstep.numerics.quant import Format, Scheme

LINEAR = re.compile(r"(_proj|_proj_with_mqa|\.indexer\.wq_b|\.indexer\.wk)\.weight$")
"""Linear layer weights, as SGLang's models name them: every `*_proj` (MLA's `kv_a_proj_with_mqa`
too) and the DSA indexer's `wq_b` / `wk` (GLM-5, DeepSeek-V3.2)."""
UNQUANTIZED = re.compile(r"\.indexer\.weights_proj\.weight$")
"""Linear layers SGLang's models build without a quantization config: always BF16."""
UNQUANTIZED_REASON = "BF16 in SGLang's model (the DSA indexer's weights_proj has no quantized form)"
FUSED_SHARDS: dict[str, tuple[str, ...]] = {
    p: group
    for group in (
        ("q_proj", "k_proj", "v_proj"),
        ("gate_proj", "up_proj"),
        ("q_a_proj", "kv_a_proj_with_mqa"),
    )
    for p in group
}
"""Projections SGLang loads as one layer (qkv_proj, gate_up_proj, MLA's fused_qkv_a_proj_with_mqa):
all shards must share a precision (its loader refuses a checkpoint that quantizes some), so an
exception on one covers its group."""


def is_linear(name: str) -> bool:
    """Whether `name` is a linear layer's weight (LINEAR); 2-D ones are the recipe's candidates."""
    return LINEAR.search(name) is not None


ROUTED_EXPERT = ".experts."
"""Routed experts stay BF16: on disk they are 2-D per-expert weights (`...mlp.experts.3.up_proj`),
in the trainer (transformers) one 3-D tensor per layer (`...mlp.experts.gate_up_proj`) that the
online export cannot quantize per expert yet, so quantizing them at conversion only would break
the four-stage contract."""
ROUTED_EXPERT_REASON = "routed expert (kept in BF16 at every stage: the trainer's experts are fused)"


@dataclass(frozen=True, slots=True)
class Decision:
    """What the recipe does with one tensor, and why."""

    quantize: bool
    reason: str
    """`quantized`, `configured bf16 exception (<pattern>)`, `contraction axis ...` or `not a linear weight`."""


@dataclass(frozen=True, slots=True)
class Recipe:
    """A serving format and the BF16 exceptions (see the module doc)."""

    scheme: Scheme
    bf16_modules: tuple[str, ...] = ()
    """fnmatch patterns over module names (`model.layers.27.*`, `*.o_proj`)."""

    def decide(self, name: str, shape: tuple[int, ...]) -> Decision:
        if not (is_linear(name) and len(shape) == 2):
            return Decision(False, "not a linear weight")
        if ROUTED_EXPERT in name:
            return Decision(False, ROUTED_EXPERT_REASON)
        if UNQUANTIZED.search(name):
            return Decision(False, UNQUANTIZED_REASON)
        module = name.removesuffix(".weight")
        parent, _, proj = module.rpartition(".")
        for sibling in FUSED_SHARDS.get(proj, (proj,)):
            other = f"{parent}.{sibling}" if parent else sibling
            for pattern in self.bf16_modules:
                if fnmatch.fnmatchcase(other, pattern):
                    fused = "" if other == module else f", fused with {sibling} in SGLang"
                    return Decision(False, f"configured bf16 exception ({pattern}{fused})")
        if not self.scheme.aligned(shape):
            return Decision(
                False,
                f"contraction axis {shape[1]} is not a multiple of the {self.scheme.block[1]}-wide blocks",
            )
        return Decision(True, "quantized")

    def quantizes(self, name: str, shape: tuple[int, ...]) -> bool:
        return self.decide(name, shape).quantize

    def ignored(self, shapes: Iterable[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Module names of the linear layers kept in BF16 (the checkpoint's ignored_layers); routed
        experts as their MoE layer's `...mlp.experts` (SGLang's FusedMoE prefix)."""
        out: set[str] = set()
        for n, s in shapes:
            if is_linear(n) and len(s) == 2 and not self.quantizes(n, s):
                i = n.find(ROUTED_EXPERT)
                out.add(n[: i + len(ROUTED_EXPERT) - 1] if i >= 0 else n.removesuffix(".weight"))
        return sorted(out)

    # -- stage 3: online export (trainer side) --------------------------------------------------

    def export(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each (HF name, tensor) as the engine loads it: quantized pairs in SGLang's layout, or as is."""
        for name, t in named:
            if self.quantizes(name, tuple(t.shape)):
                yield from quant.to_checkpoint(name, quant.quantize(t, self.scheme))
            else:
                yield name, t

    def served(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """What an engine holds after loading `export(named)`: fake-quantized where quantized."""
        for name, t in named:
            yield name, quant.fake_quantize(t, self.scheme) if self.quantizes(name, tuple(t.shape)) else t

    # -- stage 2: training forward --------------------------------------------------------------

    def install_training(self, model: Any) -> list[str]:
        """Make the model's quantized linear layers compute with fake_quantize(weight) (gradients pass
        straight through to the full-precision weight); returns the module names it covered.

        Call after lockstep.numerics.exact.apply when both are on (the exact kernel is kept).
        """
        covered = []
        for mname, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and self.quantizes(
                f"{mname}.weight", tuple(module.weight.shape)
            ):
                _fake_quant_forward(module, self.scheme)
                covered.append(mname)
        return covered


class _FakeQuant(torch.autograd.Function):
    """fake_quantize in the forward, identity in the backward (straight-through estimator)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, scheme: Scheme) -> torch.Tensor:
        return quant.fake_quantize(w, scheme)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _fake_quant_forward(module: Any, scheme: Scheme) -> None:
    """Route the module's weight through _FakeQuant on every call (the exact kernel honours it too)."""
    setattr(module, exact.WEIGHT_VIEW_ATTR, lambda w: _FakeQuant.apply(w, scheme))
    if "forward" not in vars(module):  # plain nn.Linear: compute with the fake-quantized weight
        module.forward = lambda x: torch.nn.functional.linear(x, exact.weight_of(module), module.bias)


# -- stage 4: the engine's load --------------------------------------------------------------------


def receive(
    named: Iterable[tuple[str, torch.Tensor]], scheme: Scheme, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine's side of stage 4: (name, tensor) pairs as received (SGLang layout) -> the weights
    to serve, in `dtype`. A weight that arrived with its scales is dequantized exactly; every other
    tensor passes as is; scales never reach the model. Buffers the update (scales may come after
    their weight)."""
    tensors = dict(named)
    consumed: set[str] = set()
    for name in list(tensors):
        if name in consumed or not name.endswith(".weight"):
            continue
        q, used = quant.from_checkpoint(name, tensors, scheme)
        if q is not None:
            consumed.update(used)
            yield name, quant.dequantize(q, dtype)
    for name, t in tensors.items():
        if name not in consumed:
            if name.rsplit(".", 1)[-1] in quant.SCALE_SUFFIXES:
                raise KeyError(
                    f"{name}: a scale without its weight {name.rsplit('.', 1)[0]}.weight in the update"
                )
            yield name, t


# -- stage 1: checkpoint conversion ------------------------------------------------------------------


def convert_checkpoint(src: Path, dst: Path, recipe: Recipe) -> Path:
    """Write the serving checkpoint of `src` (HF layout) into `dst`: weights through `export`, one
    shard at a time (a model larger than memory converts in the memory of its largest shard) into a
    shard of the same name with the same index, config.json with the `quantization_config` SGLang
    reads (exceptions as ignored layers), the other files (tokenizer, chat template) copied.
    Returns dst."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    shards = sorted(src.glob("*.safetensors"))
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for f in shards:
        with safe_open(str(f), "pt") as h:
            shapes += [(n, tuple(h.get_slice(n).get_shape())) for n in h.keys()]  # noqa: SIM118
    weight_map: dict[str, str] = {}
    total = 0
    for f in shards:
        out = dict(recipe.export(load_file(str(f)).items()))
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, f.name))
        total += sum(t.numel() * t.element_size() for t in out.values())
    if len(shards) > 1:  # SGLang and transformers find every tensor's shard through the index
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = recipe.scheme.quantization_config(recipe.ignored(shapes))
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if (
            f.is_file()
            and f.suffix != ".safetensors"
            and f.name not in ("config.json", "model.safetensors.index.json")
        ):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def checkpoint_scheme(config: dict[str, Any]) -> Scheme | None:
    """The serving scheme a checkpoint's config.json declares (None: not quantized)."""
    qc = config.get("quantization_config")
    return None if not qc else Scheme.from_quantization_config(qc)


def recipe_of(job: RLJob) -> Recipe | None:
    """The job's serving recipe: spec.rollout.precision and spec.model.bf16Modules (None for bf16)."""
    precision = job.spec.rollout.precision
    if precision is Precision.BF16:
        return None
    return Recipe(Scheme.of(Format(precision.value)), tuple(job.spec.model.bf16_modules))


def training_recipe(job: RLJob) -> Recipe | None:
    """The recipe the trainer's forward follows (stage 2): spec.trainer.precision, same exceptions."""
    precision = job.spec.trainer.precision
    if precision is Precision.BF16:
        return None
    return Recipe(Scheme.of(Format(precision.value)), tuple(job.spec.model.bf16_modules))
