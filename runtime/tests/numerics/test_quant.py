"""The shared quantizer against the format definitions: scale rules, rounding, saturation, layout.

Golden values are derived by hand from the definitions in lockstep.numerics.quant's module doc
(E4M3: 3 mantissa bits, max 448; E2M1: {0, .5, 1, 1.5, 2, 3, 4, 6}; UE8M0: a power of two as the
biased exponent byte). Round trips: export (to_checkpoint, a real safetensors file) and load
(from_checkpoint) give bit-identical dequantized weights for each format.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lockstep.numerics.quant import (
    Format,
    Scheme,
    dequantize,
    e2m1_codes,
    e2m1_values,
    fake_quantize,
    from_checkpoint,
    pack_e2m1,
    quantize,
    to_checkpoint,
    unpack_e2m1,
)
from safetensors.torch import load_file, save_file

FORMATS = [Format.FP8, Format.MXFP8, Format.NVFP4]


def _w(shape: tuple[int, int] = (64, 96), seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05


# -------------------------------------------------------------------------------------- E2M1 / E4M3


@pytest.mark.parametrize(
    ("x", "value"),
    [
        (0.25, 0.0),  # tie between 0 (code 0) and 0.5 (code 1): the even code
        (0.26, 0.5),
        (0.75, 1.0),  # tie 0.5 (code 1) / 1.0 (code 2): even
        (1.25, 1.0),  # tie 1.0 (code 2) / 1.5 (code 3): even
        (1.75, 2.0),
        (2.5, 2.0),
        (3.5, 4.0),
        (5.0, 4.0),  # tie 4 (code 6) / 6 (code 7): even
        (5.01, 6.0),
        (100.0, 6.0),  # saturates
        (-0.75, -1.0),
        (-7.0, -6.0),
    ],
)
def test_e2m1_rounds_to_nearest_even_and_saturates(x: float, value: float) -> None:
    assert e2m1_values(e2m1_codes(torch.tensor([x])))[0].item() == value


def test_e2m1_packs_two_values_a_byte_low_nibble_first() -> None:
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.float4_e2m1fn_x2
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_e2m1(packed), codes)


def test_fp8_block_scale_is_amax_over_448_and_values_saturate() -> None:
    w = torch.zeros(4, 8)
    w[0, 0], w[1, 1] = 896.0, -3.0  # one block [128, 128] covers everything: amax 896
    q = quantize(w, Scheme.of(Format.FP8))
    assert q.scale.tolist() == [[2.0]]  # 896 / 448
    assert q.values.float()[0, 0].item() == 448.0 and q.values.float()[1, 1].item() == -1.5
    assert dequantize(q)[0, 0].item() == 896.0


def test_fp8_uses_the_declared_block_size() -> None:
    w = _w((8, 8))
    w[:4, :4] *= 100  # one block much larger than the others
    q = quantize(w, Scheme.of(Format.FP8, (4, 4)))
    assert q.scale.shape == (2, 2)
    assert q.scale[0, 0] > 50 * q.scale[1, 1]
    assert Scheme.from_quantization_config({"quant_method": "fp8", "weight_block_size": [4, 4]}).block == (
        4,
        4,
    )


def test_fp8_rounding_is_e4m3_nearest_even() -> None:
    # Scale 1 (amax 448): 1.0625 lies halfway between 1.0 and 1.125 -> the even mantissa 1.0;
    # 1.1875 lies halfway between 1.125 and 1.25 -> 1.25.
    w = torch.tensor([[448.0, 1.0625, 1.1875, -1.0625]])
    q = quantize(w, Scheme.of(Format.FP8))
    assert q.values.float().tolist() == [[448.0, 1.0, 1.25, -1.0]]


def test_mxfp8_scale_is_the_smallest_power_of_two_that_fits() -> None:
    w = torch.zeros(3, 32)
    w[0, 0], w[1, 0], w[2, 0] = 448.0, 449.0, 1.0
    q = quantize(w, Scheme.of(Format.MXFP8))
    exps = q.scale.view(torch.uint8).int()[:, 0] - 127
    assert exps.tolist() == [0, 1, -8]  # 448 fits 2^0; 449 needs 2^1; 1.0 <= 448 * 2^-8 = 1.75
    assert q.scale.dtype == torch.float8_e8m0fnu
    assert dequantize(q)[:, 0].tolist() == [448.0, 448.0, 1.0]  # 449 / 2 = 224.5 -> 224 in E4M3


def test_mxfp8_zero_block_has_the_smallest_scale() -> None:
    q = quantize(torch.zeros(1, 32), Scheme.of(Format.MXFP8))
    assert q.scale.view(torch.uint8).tolist() == [[0]]
    assert dequantize(q).abs().sum() == 0


def test_nvfp4_two_level_scales() -> None:
    w = torch.zeros(2, 16)
    w[0, 0] = 6.0 * 448.0  # the tensor amax: s2 = amax / (448 * 6) = 1
    w[1, :2] = torch.tensor([3.0, 1.0])  # block amax 3: block scale 3 / 6 / 1 = 0.5 (exact in E4M3)
    q = quantize(w, Scheme.of(Format.NVFP4))
    assert q.scale2 is not None and q.scale2.item() == 1.0
    assert q.scale.float()[:, 0].tolist() == [448.0, 0.5]
    assert dequantize(q)[1, :2].tolist() == [3.0, 1.0]  # codes 6 and 2 times 0.5
    assert dequantize(q)[0, 0].item() == 6.0 * 448.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_misaligned_contraction_axis_is_refused_for_block_formats(fmt: Format) -> None:
    s = Scheme.of(fmt)
    if fmt is Format.FP8:
        assert s.aligned((10, 33))  # fp8 blocks may be partial
        return
    assert not s.aligned((10, 33))
    with pytest.raises(ValueError, match="keep it in bf16"):
        quantize(torch.ones(10, 33), s)


# ---------------------------------------------------------------------------------------- round trips


def test_mxfp8_is_idempotent_on_its_own_output() -> None:
    """Power-of-two scales: re-quantizing served values changes nothing (NVFP4's two-level scales
    and FP8's amax / 448 may move by rounding, which is why stages share quantized values, never
    re-quantize dequantized ones)."""
    s = Scheme.of(Format.MXFP8)
    once = fake_quantize(_w(), s)
    assert torch.equal(fake_quantize(once, s), once)


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_is_bounded_by_the_format(fmt: Format) -> None:
    w = _w()
    rel = float((fake_quantize(w, Scheme.of(fmt)) - w).norm() / w.norm())
    assert rel < {Format.FP8: 0.05, Format.MXFP8: 0.05, Format.NVFP4: 0.15}[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_then_load_through_safetensors_is_bit_exact(
    fmt: Format, dtype: torch.dtype, tmp_path: Path
) -> None:
    s = Scheme.of(fmt)
    w = _w().to(dtype)
    q = quantize(w, s)
    path = tmp_path / "model.safetensors"
    save_file(dict(to_checkpoint("model.layers.0.mlp.up_proj.weight", q)), str(path))
    loaded = load_file(str(path))
    back, used = from_checkpoint("model.layers.0.mlp.up_proj.weight", loaded, s)
    assert back is not None and sorted(used) == sorted(loaded)
    assert torch.equal(dequantize(back, dtype), dequantize(q, dtype))
    assert torch.equal(dequantize(back, dtype), fake_quantize(w, s))


@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoint_layout_is_sglangs(fmt: Format) -> None:
    pairs = dict(to_checkpoint("m.weight", quantize(_w((64, 96)), Scheme.of(fmt))))
    layout = {k: (v.dtype, tuple(v.shape)) for k, v in pairs.items()}
    assert (
        layout
        == {
            Format.FP8: {
                "m.weight": (torch.float8_e4m3fn, (64, 96)),
                "m.weight_scale_inv": (torch.float32, (1, 1)),
            },
            Format.MXFP8: {
                "m.weight": (torch.float8_e4m3fn, (64, 96)),
                "m.weight_scale_inv": (torch.uint8, (64, 3)),
            },
            Format.NVFP4: {
                "m.weight": (torch.uint8, (64, 48)),
                "m.weight_scale": (torch.float8_e4m3fn, (64, 6)),
                "m.weight_scale_2": (torch.float32, ()),
                "m.input_scale": (torch.float32, ()),  # w4a4: the activations' global scale
            },
        }[fmt]
    )
    qc = Scheme.of(fmt).quantization_config(["lm_head"])
    assert Scheme.from_quantization_config(qc) == Scheme.of(fmt)


def test_a_tensor_without_scales_is_not_quantized() -> None:
    q, used = from_checkpoint(
        "model.norm.weight", {"model.norm.weight": torch.ones(4)}, Scheme.of(Format.FP8)
    )
    assert q is None and used == []
