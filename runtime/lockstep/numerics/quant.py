"""The one quantizer: FP8 block-scaled, MXFP8 and NVFP4, shared by every stage that touches weights.

Why it exists: low precision is a four-stage contract (§6): checkpoint conversion, training
forward, online export and rollout must see the same quantized values, or the two sides run
different policies from one checkpoint. So there is exactly one `quantize` and one `dequantize`, and
each stage calls them: the conversion and the export write what `quantize` returns in SGLang's
checkpoint layout (`to_checkpoint`), the engine reads it back (`from_checkpoint`) and dequantizes
exactly what it received, the trainer's fake-quant forward is `dequantize(quantize(w))`.

Formats (all scale the last axis, the contraction axis of a linear weight [out, in]):
- `fp8`: E4M3 values, one float32 scale per [bn, bk] block (`weight_block_size` of SGLang's
  `quantization_config`, default [128, 128]); scale = amax / 448 (1.0 for an all-zero block),
  q = clamp(w / scale, -448, 448) rounded to nearest even. Stored as `weight` (float8_e4m3fn) and
  `weight_scale_inv` (float32 [ceil(out/bn), ceil(in/bk)]), w ~ q * scale.
- `mxfp8` (OCP MX): 32 consecutive E4M3 values share a UE8M0 scale 2^e, e the smallest integer with
  amax <= 448 * 2^e (NVIDIA's round-up rule, so no value saturates), e in [-127, 127]. Stored as
  `weight` (float8_e4m3fn) and `weight_scale_inv` (uint8, e + 127: the float8_e8m0fnu bits).
- `nvfp4`: 16 consecutive E2M1 values (+-{0, .5, 1, 1.5, 2, 3, 4, 6}, nearest even, saturating at
  6) share an E4M3 scale, under one float32 per-tensor scale s2 = amax / (448 * 6); the block scale is
  amax_block / 6 / s2 rounded to E4M3, and w ~ q * (scale * s2). Stored as ModelOpt's `weight`
  (uint8, two values a byte, element 2i in the low nibble: torch.float4_e2m1fn_x2 bits),
  `weight_scale` (float8_e4m3fn), `weight_scale_2` (float32 scalar) and `input_scale` (float32
  scalar, the activations' global scale). Projections SGLang fuses into one layer (q/k/v, gate/up,
  an expert's gate/up) share one s2, from the group's amax (`group_amax`): SGLang keeps one
  weight_scale_2 per fused layer (the max of the shards', or the gate's for MoE w13), so shards
  quantized under different s2 would be served wrong.
- NVFP4 activations (SGLang's modelopt_fp4 is w4a4): `fake_quantize_activation(x, input_scale)`
  quantizes every 16 consecutive values of the contraction axis to E2M1 under an E4M3 scale
  amax / 6 / input_scale, exactly the weights' rule with s2 = input_scale, and gives back what they
  stand for. Lockstep writes no calibrated input_scale: it is NVFP4_INPUT_SCALE (1.0, the value
  SGLang's ModelOpt linear layer holds when a checkpoint carries none), written into every NVFP4
  checkpoint and update so the engines compute with the one that arrived.

Who calls it: lockstep.numerics.recipe (which tensors), lockstep.weights.quantizing (export),
lockstep.engine (load), lockstep.train.fsdp (fake-quant forward), `lockstep precision-check`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
E2M1_MAX = 6.0
"""Largest E2M1 value."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 magnitudes by code 0..7 (code 8..15: the same, negative)."""
MX_BLOCK = 32
"""Values per UE8M0 scale in MXFP8."""
NVFP4_BLOCK = 16
"""Values per E4M3 scale in NVFP4."""
NVFP4_INPUT_SCALE = 1.0
"""The activations' global scale of every NVFP4 layer (no calibration; SGLang's default)."""
DEFAULT_FP8_BLOCK = (128, 128)
"""weight_block_size when a quantization_config names none (DeepSeek-V3 / SGLang's default)."""


class Format(enum.StrEnum):
    """A serving weight format; the values are lockstep.api.Precision's."""

    FP8 = "fp8"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"


@dataclass(frozen=True, slots=True)
class Scheme:
    """A format and its block shape: what `quantize` needs besides the tensor."""

    format: Format
    block: tuple[int, int] = DEFAULT_FP8_BLOCK
    """[rows, cols] of one scale block; fixed by the format except for fp8."""

    @classmethod
    def of(cls, fmt: Format | str, fp8_block: tuple[int, int] = DEFAULT_FP8_BLOCK) -> Scheme:
        f = Format(fmt)
        block = {Format.FP8: fp8_block, Format.MXFP8: (1, MX_BLOCK), Format.NVFP4: (1, NVFP4_BLOCK)}[f]
        return cls(f, (int(block[0]), int(block[1])))

    def aligned(self, shape: tuple[int, ...]) -> bool:
        """Whether a weight of this shape can be quantized: 2-D, and for the MX/NV formats the
        contraction axis a whole number of blocks (fp8 blocks may be partial, as SGLang allows)."""
        if len(shape) != 2:
            return False
        return self.format is Format.FP8 or shape[1] % self.block[1] == 0

    def quantization_config(self, ignored: list[str]) -> dict[str, Any]:
        """The config.json `quantization_config` SGLang reads for a checkpoint in this scheme."""
        if self.format is Format.NVFP4:
            return {
                "quant_method": "modelopt",
                "quant_algo": "NVFP4",
                "group_size": NVFP4_BLOCK,
                "exclude_modules": ignored,
            }
        return {
            "quant_method": self.format.value,
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.block),
            "ignored_layers": ignored,
        }

    @classmethod
    def from_quantization_config(cls, qc: dict[str, Any]) -> Scheme:
        """The scheme of a checkpoint's `quantization_config` (SGLang's fp8 / mxfp8 / modelopt NVFP4)."""
        method = str(qc.get("quant_method", ""))
        if method == "modelopt" and str(qc.get("quant_algo", "")).upper() == "NVFP4":
            return cls.of(Format.NVFP4)
        if method == "mxfp8":
            return cls.of(Format.MXFP8)
        if method == "fp8":
            block = qc.get("weight_block_size") or DEFAULT_FP8_BLOCK
            return cls.of(Format.FP8, (int(block[0]), int(block[1])))
        raise ValueError(
            f"quantization_config quant_method {method!r} is not one Lockstep serves; "
            "use a fp8 (block), mxfp8 or modelopt NVFP4 checkpoint, or a bf16 one"
        )


@dataclass(frozen=True, slots=True)
class Quantized:
    """One quantized weight: values, block scales and (NVFP4) the per-tensor scale."""

    scheme: Scheme
    values: torch.Tensor
    """float8_e4m3fn [out, in] (fp8, mxfp8) or float4_e2m1fn_x2 [out, in / 2] (nvfp4)."""
    scale: torch.Tensor
    """float32 [ceil(out/bn), ceil(in/bk)] (fp8), float8_e8m0fnu [out, in/32] (mxfp8),
    float8_e4m3fn [out, in/16] (nvfp4)."""
    scale2: torch.Tensor | None = None
    """float32 scalar per-tensor scale (nvfp4 only)."""
    input_scale: torch.Tensor | None = None
    """float32 scalar global scale of the layer's activations (nvfp4 only)."""


def _blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[out, in] -> zero-padded [Ro, Ci, bn, bk] blocks (float32)."""
    bn, bk = block
    n, k = w.shape
    pad = torch.nn.functional.pad(w.float(), (0, -k % bk, 0, -n % bn))
    return pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).permute(0, 2, 1, 3)


def _unblocks(x: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """[Ro, Ci, bn, bk] -> [out, in] (the padding cut off)."""
    ro, ci, bn, bk = x.shape
    return x.permute(0, 2, 1, 3).reshape(ro * bn, ci * bk)[: shape[0], : shape[1]]


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, saturating at +-448 (torch's cast rounds to nearest even)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 -> E2M1 codes (uint8 0..15), nearest with ties to the even code, saturating at 6.

    A magnitude passes a midpoint strictly when the code below it is even (a tie stays there) and
    inclusively when it is odd (a tie moves up to the even code).
    """
    a = x.abs()
    code = torch.zeros_like(a, dtype=torch.uint8)
    for mid, ties_up in (
        (0.25, False),
        (0.75, True),
        (1.25, False),
        (1.75, True),
        (2.5, False),
        (3.5, True),
        (5.0, False),
    ):
        code += (a >= mid if ties_up else a > mid).to(torch.uint8)
    return code | ((x < 0) & (code > 0)).to(torch.uint8) << 3


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8) -> float32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes [out, in] -> float4_e2m1fn_x2 [out, in / 2] (element 2i in the low nibble)."""
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous().view(torch.float4_e2m1fn_x2)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 (or uint8) [out, in / 2] -> codes uint8 [out, in]."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(b.shape[0], b.shape[1] * 2)


def group_amax(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The amax over the weights SGLang fuses into one layer (NVFP4's shared s2 comes from it)."""
    amaxes = []
    for t in tensors:
        a = t.detach().abs().amax().float()
        full = getattr(a, "full_tensor", None)  # a sharded (FSDP2 DTensor) parameter: the global amax
        amaxes.append(full() if callable(full) else a)
    return torch.stack(amaxes).amax()


def quantize(w: torch.Tensor, scheme: Scheme, shared_amax: torch.Tensor | None = None) -> Quantized:
    """Quantize a 2-D weight [out, in] (any float dtype) in `scheme`; see the module doc for the rules.

    shared_amax (nvfp4): the amax of the fused group `w` belongs to (`group_amax`), from which s2 comes;
    None: w's own."""
    if not scheme.aligned(tuple(w.shape)):
        raise ValueError(
            f"{scheme.format} cannot quantize a tensor of shape {tuple(w.shape)}: its contraction axis is "
            f"not a whole number of {scheme.block[1]}-wide blocks; keep it in bf16 (a recipe exception)"
        )
    w = w.detach()
    if scheme.format is Format.FP8:
        blocks = _blocks(w, scheme.block)  # [Ro, Ci, bn, bk]
        amax = blocks.abs().amax(dim=(-1, -2))  # [Ro, Ci]
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        q = to_e4m3(_unblocks(blocks / scale[..., None, None], (w.shape[0], w.shape[1])))
        return Quantized(scheme, q, scale)
    rows = w.float().reshape(w.shape[0], -1, scheme.block[1])  # [out, in / b, b]
    amax = rows.abs().amax(dim=-1)  # [out, in / b]
    if scheme.format is Format.MXFP8:
        e = _mx_exponent(amax)
        q = to_e4m3(torch.ldexp(rows, -e[..., None].float()).reshape(w.shape))
        return Quantized(scheme, q, (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu))
    if shared_amax is not None:
        tensor_amax = shared_amax.detach().float().to(w.device)
    else:
        tensor_amax = amax.max() if amax.numel() else torch.zeros((), device=w.device)
    s2 = torch.where(tensor_amax > 0, tensor_amax / (E4M3_MAX * E2M1_MAX), torch.ones_like(tensor_amax))
    scale, codes = _nvfp4_blocks(rows, amax, s2)
    input_scale = torch.tensor(NVFP4_INPUT_SCALE, dtype=torch.float32, device=w.device)
    return Quantized(scheme, pack_e2m1(codes.reshape(w.shape)), scale, s2.float(), input_scale)


def _nvfp4_blocks(
    rows: torch.Tensor, amax: torch.Tensor, s2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of 16-value blocks `rows` [..., n / 16, 16] (amax [..., n / 16]) under the global scale
    s2: the E4M3 block scales and the E2M1 codes (one rule for weights and activations)."""
    scale = to_e4m3(amax / E2M1_MAX / s2)  # [..., n / 16]
    eff = scale.float() * s2  # the factor SGLang multiplies back
    scaled = torch.where(eff[..., None] > 0, rows / eff[..., None], torch.zeros_like(rows))
    return scale, e2m1_codes(scaled)


def fake_quantize_activation(x: torch.Tensor, input_scale: torch.Tensor | float) -> torch.Tensor:
    """NVFP4 activations (w4a4): `x` [..., in] quantized per 16 consecutive values of its last axis
    under the global scale `input_scale`, returned as the values they stand for, in x's dtype.

    Emulated in float32: SGLang's kernel quantizes to FP4 and multiplies on FP4 tensor cores (it
    computes the block scale's reciprocal with an approximate reciprocal, so a value on a rounding
    tie may land one code apart); the values here are the format's."""
    n = x.shape[-1]
    if n % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 activations: the contraction axis {n} is not a multiple of {NVFP4_BLOCK}")
    rows = x.detach().float().reshape(*x.shape[:-1], n // NVFP4_BLOCK, NVFP4_BLOCK)
    s2 = torch.as_tensor(input_scale, dtype=torch.float32, device=x.device).reshape(())
    scale, codes = _nvfp4_blocks(rows, rows.abs().amax(dim=-1), s2)
    return (e2m1_values(codes) * (scale.float() * s2)[..., None]).reshape(x.shape).to(x.dtype)


def _mx_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Smallest integer e with amax <= 448 * 2^e, clamped to UE8M0's [-127, 127] (int32)."""
    _, exp2 = torch.frexp(amax / E4M3_MAX)  # amax / 448 = m * 2^exp2, m in [0.5, 1)
    e = exp2.to(torch.int32)
    # Division rounding may leave e one off; fix it with exact power-of-two products.
    e = torch.where(amax > torch.ldexp(torch.full_like(amax, E4M3_MAX), e.float()), e + 1, e)
    e = torch.where(amax <= torch.ldexp(torch.full_like(amax, E4M3_MAX), (e - 1).float()), e - 1, e)
    return torch.where(amax > 0, e, torch.full_like(e, -127)).clamp(-127, 127)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight `q` stands for, in `dtype` (computed in float32, then cast once)."""
    s = q.scheme
    if s.format is Format.FP8:
        n, k = q.values.shape
        scale = q.scale.float().repeat_interleave(s.block[0], 0).repeat_interleave(s.block[1], 1)[:n, :k]
        return (q.values.float() * scale).to(dtype)
    if s.format is Format.MXFP8:
        exps = q.scale.view(torch.uint8).to(torch.int32) - 127  # [out, in / 32]
        rows = q.values.float().reshape(exps.shape[0], -1, MX_BLOCK)
        return torch.ldexp(rows, exps[..., None].float()).reshape(q.values.shape).to(dtype)
    assert q.scale2 is not None
    vals = e2m1_values(unpack_e2m1(q.values))  # [out, in]
    eff = q.scale.float() * q.scale2.float()  # [out, in / 16]
    return (vals.reshape(eff.shape[0], -1, NVFP4_BLOCK) * eff[..., None]).reshape(vals.shape).to(dtype)


def fake_quantize(w: torch.Tensor, scheme: Scheme, shared_amax: torch.Tensor | None = None) -> torch.Tensor:
    """dequantize(quantize(w)) in w's dtype: what the engine serves for w (the training forward's view)."""
    return dequantize(quantize(w, scheme, shared_amax), w.dtype)


# ------------------------------------------------------------------------ SGLang checkpoint layout

SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")
"""Tensor names that travel next to a quantized `<module>.weight`."""


def to_checkpoint(name: str, q: Quantized) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of `q` in SGLang's checkpoint layout; `name` ends with `.weight`."""
    module = name.removesuffix(".weight")
    if q.scheme.format is Format.FP8:
        return [(name, q.values), (f"{module}.weight_scale_inv", q.scale)]
    if q.scheme.format is Format.MXFP8:
        return [(name, q.values), (f"{module}.weight_scale_inv", q.scale.view(torch.uint8))]
    assert q.scale2 is not None
    input_scale = q.input_scale if q.input_scale is not None else torch.tensor(NVFP4_INPUT_SCALE)
    return [
        (name, q.values.view(torch.uint8)),
        (f"{module}.weight_scale", q.scale),
        (f"{module}.weight_scale_2", q.scale2.reshape(())),
        (f"{module}.input_scale", input_scale.float().reshape(())),
    ]


def from_checkpoint(
    name: str, tensors: dict[str, torch.Tensor], scheme: Scheme
) -> tuple[Quantized | None, list[str]]:
    """The quantized weight `name` as stored in `tensors` (SGLang layout), and the names it used.

    Returns (None, []) when `name` carries no scale (a bf16 exception or a non-linear tensor). An
    NVFP4 layer without `input_scale` gets NVFP4_INPUT_SCALE, as SGLang's does.
    """
    module = name.removesuffix(".weight")
    if scheme.format is Format.NVFP4:
        scale_name, s2_name = f"{module}.weight_scale", f"{module}.weight_scale_2"
        in_name = f"{module}.input_scale"
        if scale_name not in tensors:
            return None, []
        has_input = in_name in tensors
        q = Quantized(
            scheme,
            tensors[name].view(torch.uint8).view(torch.float4_e2m1fn_x2),
            tensors[scale_name].view(torch.float8_e4m3fn),
            tensors[s2_name].float(),
            tensors[in_name].float() if has_input else torch.tensor(NVFP4_INPUT_SCALE),
        )
        return q, [name, scale_name, s2_name] + ([in_name] if has_input else [])
    scale_name = f"{module}.weight_scale_inv"
    if scale_name not in tensors:
        return None, []
    scale = tensors[scale_name]
    scale = (
        scale.view(torch.uint8).view(torch.float8_e8m0fnu) if scheme.format is Format.MXFP8 else scale.float()
    )
    return Quantized(scheme, tensors[name].view(torch.float8_e4m3fn), scale), [name, scale_name]
