"""The low-precision recipe: which tensors are quantized, declared once, applied at all four stages.

Why it exists: §6 makes low precision a contract over four stages (1 checkpoint conversion,
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
indexer's `wq_b` / `wk`: LINEAR) and expert weights, per expert and projection (lockstep.numerics.experts:
the trainer's fused 3-D tensors are split into SGLang's per-expert names); embeddings, norms, routers
and lm_head stay in the checkpoint dtype, as in SGLang's FP8 checkpoints, and so do the linear layers
SGLang builds unquantized (UNQUANTIZED). A projection is an exception when a bf16Modules pattern
matches its module name (fnmatch) or that of a projection SGLang fuses it with (q/k/v, gate/up:
FUSED_SHARDS), or when its contraction axis is not a whole number of blocks (MXFP8: 32, NVFP4: 16).
A MoE layer's expert weights are one layer to SGLang (FusedMoE: quantized or skipped whole), so they
are decided together (`_decide_experts`): BF16 when a pattern matches the layer (`...mlp.experts`) or
an expert projection with the expert index written `*` (`...mlp.experts.*.down_proj`), or when
their sizes break SGLang's MoE loaders (I or H not a whole number of MXFP8/NVFP4 blocks; fp8: I not
a whole number of block rows and columns, which SGLang's Fp8MoEMethod refuses, the columns with
tensor parallelism). A pattern naming one expert
(`...experts.3...`) is refused: SGLang cannot keep one expert in BF16.

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

from lockstep.numerics import exact, experts, quant
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


ONE_EXPERT = re.compile(r"\.experts\.\d")
"""A bf16Modules pattern naming one routed expert (refused: SGLang's FusedMoE is one precision)."""


def _group_members(name: str) -> set[str]:
    """The weight names of the fused layer `name` belongs to (fusion_key's group)."""
    x = experts.parse(name)
    if x is not None and x.expert is not None:
        return {experts.per_expert_name(x.layer, x.expert, p) for p in ("gate_proj", "up_proj")}
    parent, _, proj = name.removesuffix(".weight").rpartition(".")
    return {f"{parent}.{p}.weight" if parent else f"{p}.weight" for p in FUSED_SHARDS.get(proj, (proj,))}


def fusion_key(name: str) -> str | None:
    """The key of the layer SGLang fuses `name` into, shared by its shards (q/k/v, gate/up, MLA's
    q_a/kv_a, an expert's gate/up): they share NVFP4's s2. None for a weight that is its own layer."""
    x = experts.parse(name)
    if x is not None:
        if x.expert is None:
            return None  # a fused 3-D tensor: each expert's group lies inside it
        return f"{x.layer}.{x.expert}.gate_up" if x.proj != "down_proj" else None
    module = name.removesuffix(".weight")
    parent, _, proj = module.rpartition(".")
    group = FUSED_SHARDS.get(proj)
    return f"{parent}.{'+'.join(group)}" if group else None


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

    def __post_init__(self) -> None:
        for pattern in self.bf16_modules:
            if ONE_EXPERT.search(pattern):
                raise ValueError(
                    f"spec.model.bf16Modules: {pattern!r} names one expert; SGLang quantizes a MoE "
                    "layer's experts as one FusedMoE: name the layer (`model.layers.N.mlp.experts`) or "
                    "every expert (`*.experts.*.down_proj`)"
                )

    def decide(self, name: str, shape: tuple[int, ...]) -> Decision:
        x = experts.parse(name)
        if x is not None:
            dims = x.dims(shape)
            if dims is None:
                return Decision(False, "not a linear weight")
            return self._decide_experts(x.layer, *dims)
        if not (is_linear(name) and len(shape) == 2):
            return Decision(False, "not a linear weight")
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

    def _decide_experts(self, layer: str, inter: int, hidden: int) -> Decision:
        """One MoE layer's expert weights (I = inter, H = hidden), decided whole (see the module doc)."""
        names = [layer] + [f"{layer}.*.{p}" for p in experts.PROJECTIONS]
        for pattern in self.bf16_modules:
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                return Decision(
                    False, f"configured bf16 exception ({pattern}, the whole MoE layer in SGLang)"
                )
        bn, bk = self.scheme.block
        if self.scheme.format is Format.FP8:
            if inter % bn or inter % bk:
                return Decision(
                    False,
                    f"expert weights: intermediate size {inter} is not a multiple of the fp8 block's "
                    f"{bn} rows and {bk} columns (SGLang's Fp8MoEMethod refuses it; the columns with "
                    "tensor parallelism, and one converted checkpoint serves every engine)",
                )
        elif inter % bk or hidden % bk:
            return Decision(
                False,
                f"expert weights: sizes I={inter}, H={hidden} are not multiples of the {bk}-wide blocks",
            )
        return Decision(True, "quantized")

    def quantizes(self, name: str, shape: tuple[int, ...]) -> bool:
        return self.decide(name, shape).quantize

    def ignored(self, shapes: Iterable[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Module names of the linear layers kept in BF16 (the checkpoint's ignored_layers); routed
        experts as their MoE layer's `...mlp.experts` (SGLang's FusedMoE prefix)."""
        out: set[str] = set()
        for n, s in shapes:
            x = experts.parse(n)
            if x is not None:
                if x.dims(s) is not None and not self.quantizes(n, s):
                    out.add(x.layer)
            elif is_linear(n) and len(s) == 2 and not self.quantizes(n, s):
                out.add(n.removesuffix(".weight"))
        return sorted(out)

    def _runs(
        self, named: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], torch.Tensor | None]]:
        """The tensors of `named` by the fused layer they belong to (NVFP4: they share s2), with the
        group's amax (None when no s2 is shared). A group is held back until all its shards have
        passed (or the stream ends); other formats and other tensors pass one at a time."""
        pending: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, t in named:
            key = None
            if self.scheme.format is Format.NVFP4 and self.quantizes(name, tuple(t.shape)):
                key = fusion_key(name)
            if key is None:
                yield [(name, t)], None
                continue
            run = pending.setdefault(key, [])
            run.append((name, t))
            if {n for n, _ in run} >= _group_members(name):
                yield pending.pop(key), quant.group_amax([w for _, w in run])
        for run in pending.values():
            yield run, quant.group_amax([w for _, w in run])

    def _quantized_pairs(
        self, name: str, t: torch.Tensor, amax: torch.Tensor | None
    ) -> Iterator[tuple[str, quant.Quantized]]:
        """(name, quantized) of one quantized tensor; a fused expert tensor per expert (SGLang's names)."""
        x = experts.parse(name)
        if x is not None and x.expert is None:
            for e in range(t.shape[0]):
                yield from self._expert_pairs(name, t, e)
            return
        yield name, quant.quantize(t, self.scheme, amax)

    def _expert_pairs(self, name: str, t: torch.Tensor, e: int) -> list[tuple[str, quant.Quantized]]:
        """Expert e of a fused expert tensor, quantized per projection (NVFP4: gate and up share s2)."""
        shared = None
        if self.scheme.format is Format.NVFP4 and name.endswith("gate_up_proj"):
            shared = quant.group_amax([t[e]])
        return [(n, quant.quantize(w, self.scheme, shared)) for n, w in experts.split_one(name, t, e)]

    def quantized_names(self, shapes: Iterable[tuple[str, tuple[int, ...]]]) -> set[str]:
        """The weights the recipe quantizes, by the names SGLang loads them under (a fused expert
        tensor as its per-expert weights)."""
        out: set[str] = set()
        for n, s in shapes:
            if not self.quantizes(n, s):
                continue
            x = experts.parse(n)
            if x is not None and x.expert is None:
                out |= {name for name, _ in experts.split(n, torch.empty(s, device="meta"))}
            else:
                out.add(n)
        return out

    # -- stage 3: online export (trainer side) --------------------------------------------------

    def quantized(
        self, named: Iterable[tuple[str, torch.Tensor]], shared_amax: dict[str, torch.Tensor] | None = None
    ) -> Iterator[tuple[str, torch.Tensor | quant.Quantized]]:
        """Each (HF name, tensor) of `named`, quantized where the recipe says (SGLang's per-expert
        names for a fused expert tensor), else as is: the one path of export and conversion.

        shared_amax: NVFP4 group amax by fusion_key, when the caller computed it over the whole
        checkpoint (convert_checkpoint: a group may straddle shards); else over the group's shards
        in `named` (held back until all have passed)."""
        for run, amax in self._runs(named):
            for name, t in run:
                if not self.quantizes(name, tuple(t.shape)):
                    yield name, t
                    continue
                key = fusion_key(name)
                if shared_amax is not None and key is not None and key in shared_amax:
                    amax = shared_amax[key]
                yield from self._quantized_pairs(name, t, amax)

    def export(
        self, named: Iterable[tuple[str, torch.Tensor]], shared_amax: dict[str, torch.Tensor] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each (HF name, tensor) as the engine loads it: quantized pairs in SGLang's layout (a fused
        expert tensor as its experts' per-expert pairs), or as is (see `quantized`)."""
        for name, x in self.quantized(named, shared_amax):
            if isinstance(x, quant.Quantized):
                yield from quant.to_checkpoint(name, x)
            else:
                yield name, x

    def served(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """What an engine holds after loading `export(named)`, under the names it holds them by:
        fake-quantized where quantized (a fused expert tensor per expert, reassembled)."""
        for run, amax in self._runs(named):
            for name, t in run:
                if not self.quantizes(name, tuple(t.shape)):
                    yield name, t
                    continue
                x = experts.parse(name)
                if x is not None and x.expert is None:
                    out = torch.empty_like(t)
                    for e in range(t.shape[0]):
                        out[e] = torch.cat(
                            [quant.dequantize(q, t.dtype) for _, q in self._expert_pairs(name, t, e)]
                        )
                    yield name, out
                else:
                    yield name, quant.fake_quantize(t, self.scheme, amax)

    # -- stage 2: training forward --------------------------------------------------------------

    def install_training(self, model: Any) -> list[str]:
        """Make the model's quantized linear layers and expert weights compute with
        fake_quantize(weight) (gradients pass straight through to the full-precision weight), NVFP4
        also with fake-quantized inputs (w4a4, `install_activations` with NVFP4_INPUT_SCALE); returns
        the module names it covered.

        Call after lockstep.numerics.exact.apply when both are on (the exact kernel is kept).
        """
        covered = []
        scales: dict[str, torch.Tensor] = {}
        modules = dict(model.named_modules())
        for mname, module in modules.items():
            if isinstance(module, torch.nn.Linear) and self.quantizes(
                f"{mname}.weight", tuple(module.weight.shape)
            ):
                _fake_quant_forward(module, self.scheme, self._siblings(mname, modules))
                covered.append(mname)
                scales[f"{mname}.input_scale"] = torch.tensor(quant.NVFP4_INPUT_SCALE)
            elif _is_experts(module) and self.quantizes(
                f"{mname}.gate_up_proj", tuple(module.gate_up_proj.shape)
            ):
                name = f"{mname}.gate_up_proj"
                hooks = getattr(module, experts.HOOKS_ATTR, None) or experts.ExpertsHooks()
                hooks.gate_up = lambda w, n=name: _FakeQuantExpert.apply(w, self, n)
                hooks.down = lambda w: _FakeQuant.apply(w, self.scheme, None)
                experts.install_forward(module, hooks)
                covered.append(mname)
                for e in range(int(module.gate_up_proj.shape[0])):
                    for p in experts.PROJECTIONS:
                        scales[f"{mname}.{e}.{p}.input_scale"] = torch.tensor(quant.NVFP4_INPUT_SCALE)
        if self.scheme.format is Format.NVFP4:
            install_activations(model, scales)
        return covered

    def _siblings(self, mname: str, modules: dict[str, Any]) -> list[Any]:
        """NVFP4: the quantized Linear modules SGLang fuses with `mname` (itself included), whose
        weights share s2; [] for the other formats or a layer of its own."""
        key = fusion_key(f"{mname}.weight")
        if self.scheme.format is not Format.NVFP4 or key is None:
            return []
        parent = mname.rpartition(".")[0]
        out = []
        for proj in FUSED_SHARDS[mname.rpartition(".")[2]]:
            m = modules.get(f"{parent}.{proj}" if parent else proj)
            if isinstance(m, torch.nn.Linear) and self.quantizes(
                f"{parent}.{proj}.weight", tuple(m.weight.shape)
            ):
                out.append(m)
        return out


def _is_experts(module: Any) -> bool:
    """A transformers (>= 5) routed-experts module: 3-D `gate_up_proj` and `down_proj` parameters."""
    w = getattr(module, "gate_up_proj", None)
    return isinstance(w, torch.Tensor) and w.dim() == 3 and hasattr(module, "down_proj")


class _FakeQuant(torch.autograd.Function):
    """fake_quantize in the forward, identity in the backward (straight-through estimator)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, scheme: Scheme, amax: torch.Tensor | None) -> torch.Tensor:
        return quant.fake_quantize(w, scheme, amax)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _FakeQuantExpert(torch.autograd.Function):
    """One expert's gate/up [2I, H] as served (per projection, one NVFP4 s2), straight-through."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, recipe: Recipe, name: str) -> torch.Tensor:
        return torch.cat([quant.dequantize(q, w.dtype) for _, q in recipe._expert_pairs(name, w[None], 0)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _FakeQuantActivation(torch.autograd.Function):
    """NVFP4 activation fake quant in the forward, identity in the backward (straight-through)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
        return quant.fake_quantize_activation(x, input_scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _fake_quant_forward(module: Any, scheme: Scheme, siblings: list[Any]) -> None:
    """Route the module's weight through _FakeQuant on every call (the exact kernel honours it too);
    NVFP4 shards of a fused layer under the group's s2 (their amax, read at each call)."""

    def view(w: torch.Tensor) -> torch.Tensor:
        amax = quant.group_amax([m.weight for m in siblings]) if siblings else None
        out: torch.Tensor = _FakeQuant.apply(w, scheme, amax)
        return out

    setattr(module, exact.WEIGHT_VIEW_ATTR, view)
    if "forward" not in vars(module):  # plain nn.Linear: compute with the fake-quantized weight
        module.forward = lambda x: torch.nn.functional.linear(x, exact.weight_of(module), module.bias)


def install_activations(model: Any, scales: dict[str, torch.Tensor]) -> list[str]:
    """NVFP4 w4a4 (SGLang's modelopt_fp4): every layer with an input scale in `scales` quantizes its
    input (`quant.fake_quantize_activation`) before its matmul: a Linear under `<module>.input_scale`
    (the max over the shards of the fused layer it belongs to, as SGLang's ModelOpt linear layer), a
    MoE layer its experts' gate/up inputs under the max of their `<layer>.<e>.{gate,up}_proj.input_scale`
    and their down inputs under the max of the `down_proj` ones (SGLang's cutlass / TRT-LLM MoE
    take the layer's max). The scales are read at each call, so an engine that receives new ones
    (the tensors in `scales`, updated in place) computes with them. Used by the training forward
    (stage 2) and the engine (stage 4); returns the module names it covered."""
    covered = []
    for mname, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and f"{mname}.input_scale" in scales:
            # one fused layer (q/k/v, gate/up) quantizes its one input under the max of its shards'
            group = [f"{n.removesuffix('.weight')}.input_scale" for n in _group_members(f"{mname}.weight")]
            shard_scales = [scales[n] for n in sorted(group) if n in scales]
            module.register_forward_pre_hook(
                lambda _m, args, ss=shard_scales: (
                    _FakeQuantActivation.apply(args[0], torch.stack(ss).amax()),
                    *args[1:],
                )
            )
            covered.append(mname)
        elif _is_experts(module) and f"{mname}.0.gate_proj.input_scale" in scales:
            per = {p: [v for k, v in scales.items() if k.startswith(f"{mname}.") and k.endswith(f".{p}.input_scale")]
                   for p in experts.PROJECTIONS}  # fmt: skip
            w13 = per["gate_proj"] + per["up_proj"]
            w2 = per["down_proj"]
            hooks = getattr(module, experts.HOOKS_ATTR, None) or experts.ExpertsHooks()
            hooks.gate_up_input = lambda x, w13=w13: _FakeQuantActivation.apply(x, torch.stack(w13).amax())
            hooks.down_input = lambda x, w2=w2: _FakeQuantActivation.apply(x, torch.stack(w2).amax())
            experts.install_forward(module, hooks)
            covered.append(mname)
    return covered


# -- stage 4: the engine's load --------------------------------------------------------------------


def receive(
    named: Iterable[tuple[str, torch.Tensor]], scheme: Scheme, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine's side of stage 4: (name, tensor) pairs as received (SGLang layout) -> the weights
    to serve, in `dtype`. A weight that arrived with its scales is dequantized exactly; every other
    tensor passes as is; weight scales never reach the model (NVFP4's `input_scale` passes, for the
    engine's activation quantization). Buffers the update (scales may come after
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
            for n in used:  # NVFP4's input scale: the engine computes its activations with it
                if n.endswith(".input_scale"):
                    yield n, tensors[n].float().reshape(())
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
    shared: dict[str, torch.Tensor] = {}
    if recipe.scheme.format is Format.NVFP4:  # a fused group's shards may lie in different files
        for f in shards:
            with safe_open(str(f), "pt") as h:
                for n in h.keys():  # noqa: SIM118
                    key = fusion_key(n)
                    if key is not None and recipe.quantizes(n, tuple(h.get_slice(n).get_shape())):
                        a = quant.group_amax([h.get_tensor(n)])
                        shared[key] = torch.maximum(shared[key], a) if key in shared else a
    weight_map: dict[str, str] = {}
    total = 0
    for f in shards:
        out = dict(recipe.export(load_file(str(f)).items(), shared))
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
