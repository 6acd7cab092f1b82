"""True on-policy against stock SGLang: the trainer computes Qwen3 dense the way SGLang's on-policy path does.

Why it exists: with `rollout.engine: sglang` (examples/h100.yaml) the rollout logprobs come from stock
SGLang launched with `--enable-deterministic-inference --rl-on-policy-target fsdp --attention-backend
fa3`, which computes with its own kernels, not with lockstep.numerics.kernels. For an exact zero the
FSDP trainer must run SGLang's computation. What SGLang (the pin, lockstep.api.profiles.SGLANG_VERSION) computes on
that path for `Qwen3ForCausalLM`, read from its source (runtime/tests/sglang/test_true_on_policy_contract.py
checks each line against the installed wheel, so a moved pin that changes one fails there):

- matmul, log_softmax and mean run SGLang's batch-invariant ops (`sglang.srt.batch_invariant_ops`:
  Triton kernels registered for aten::mm, addmm, _log_softmax, mean.dim, rms_norm). The trainer
  enables the same module from the same package (the trainer image carries the pinned SGLang), with
  bmm left alone (Qwen3's path has none). Its matmul takes DeepGEMM when deep_gemm is importable;
  `SGLANG_TRUE_ON_POLICY_ENV` turns that off on both sides, so both run the one Triton persistent
  kernel whatever each image carries (and the kernel the H200 tests check).
- the embedding table and the residual stream are float32 (`params_dtype=float32`, `fp32_residual`);
- RMSNorm is SGLang's native one with a float32 weight: `x32 * rsqrt(mean(x32^2) + eps)`, then
  `weight32 * x32` for the decoder and final norms (float32 out, `override_orig_dtype=float32`) and
  `weight32 * bf16(x)` for the q/k norms (`cast_x_before_out_mul`, float32 out);
- every projection casts its input to bf16 (`hidden_states.bfloat16()`) and multiplies bf16 weights;
- RoPE: a float32 cos/sin cache (inv_freq on the CPU, `einsum(t, inv_freq)`, cos and sin on the
  device), applied to the float32 q and k by the neox formula compiled with `torch.compile(dynamic=True)`
  (SGLang's `_force_native`); q and k are cast to bf16 before attention;
- attention: FlashAttention-3 with one split (`num_splits=1`); the trainer uses transformers'
  `flash_attention_3` (as Miles does);
- the MLP activation is `F.silu(gate) * up` in bf16 (SGLang's native SiluAndMul);
- logits are `bf16(h) @ bf16(W)^T` in bf16; the sampled token's logprob is
  `log_softmax(bf16(bf16(logits) / temperature))`, temperature a float32 tensor, in bf16.

`apply(model, device)` installs that into the HF modules in place (the trainer's transformers forward
under FSDP2 then runs it); `token_logprobs` is the logprob. Refused with a named fix: no CUDA, no SGLang
at the pin in the trainer image, SGLang's ops loaded with DeepGEMM on, a model that is not Qwen3 dense,
parameters that are not bf16.

Not verified here (SGLang cannot run on the development machines or the lent H200): FA3 decode
against FA3 varlen prefill, and the whole engine against this trainer end to end; see
docs/true-on-policy.md.

Who calls it: lockstep.train.fsdp (trainer.kernels `sglang`, chosen by lockstep.api.profiles).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from typing import Any, Final

import torch

from lockstep.api.profiles import SGLANG_TRUE_ON_POLICY_ENV, SGLANG_VERSION
from lockstep.numerics import exact

OPS_MODULE: Final = "sglang.srt.batch_invariant_ops"
"""SGLang's batch-invariant ops, enabled in the trainer process."""

DEEPGEMM_SWITCH: Final = "SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_DEEPGEMM"
"""Read by SGLang's ops at import; SGLANG_TRUE_ON_POLICY_ENV sets it to 0 on both sides."""

ATTN_IMPLEMENTATION: Final = "flash_attention_3"
"""The trainer's attention (transformers' FA3 integration; SGLang's is `--attention-backend fa3`)."""

_APPLIED_ATTR = "_lockstep_sglang_kernels"


def load_ops() -> Any:
    """SGLang's batch-invariant ops module from the trainer image's SGLang, DeepGEMM off.

    Raises RuntimeError naming the fix when SGLang is missing, at another version, or its ops module
    was already imported with DeepGEMM on.
    """
    for key, value in SGLANG_TRUE_ON_POLICY_ENV.items():
        os.environ[key] = value  # read by the module at import
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version != SGLANG_VERSION:
        raise RuntimeError(
            f"trainer kernels `sglang` need sglang=={SGLANG_VERSION} in the trainer image (found "
            f"{version or 'none'}): set spec.trainer.image to an image built by images/trainer-sglang.Dockerfile, "
            "or serve with rollout.engine reference"
        )
    try:
        ops = importlib.import_module(OPS_MODULE)
    except ImportError as e:
        raise RuntimeError(
            f"{OPS_MODULE} does not import in the trainer image ({e}): set spec.trainer.image to an image built "
            "by images/trainer-sglang.Dockerfile (SGLang's image, which carries its dependencies)"
        ) from e
    return check_ops(ops)


def check_ops(ops: Any) -> Any:
    """`ops` if it computes as the engines do (DeepGEMM off); raises RuntimeError otherwise."""
    if getattr(ops, "_ENABLE_MM_DEEPGEMM", None) is not False:
        raise RuntimeError(
            f"{OPS_MODULE} was imported with DeepGEMM on: set {DEEPGEMM_SWITCH}=0 in the trainer's "
            "environment before SGLang is imported (the engine pods run with it)"
        )
    return ops


def applied(model: Any) -> bool:
    """Whether `apply` installed SGLang's computation into `model`."""
    return bool(getattr(model, _APPLIED_ATTR, False))


def apply(
    model: Any, device: torch.device | str, ops: Any | None = None, attention: str | None = None
) -> None:
    """Install SGLang's Qwen3 on-policy computation into `model` (in place) and enable SGLang's ops.

    ops: SGLang's batch-invariant ops module (default `load_ops()`); attention: the transformers
    attention implementation (default FA3; tests on machines without FA3 pass `lockstep_exact`, a
    batch-invariant stand-in, and say so). Raises ValueError / RuntimeError naming the fix.
    """
    config = model.config
    if getattr(config, "model_type", None) != "qwen3":
        raise ValueError(
            f"model_type {getattr(config, 'model_type', None)!r}: trainer kernels `sglang` reproduce SGLang's "
            "Qwen3 dense path only; use rollout.engine reference or a registered Qwen3 dense model"
        )
    if str(getattr(config, "hidden_act", "silu")) != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r}: SGLang's Qwen3 path runs silu only")
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.bfloat16}:
        raise ValueError(
            f"parameters in {sorted(map(str, dtypes))}: trainer kernels `sglang` compute from the bf16 "
            "weights the engine receives; set trainer.precision bf16 on CUDA"
        )
    if torch.device(device).type != "cuda":
        raise ValueError(
            "trainer kernels `sglang` run on CUDA only (SGLang's ops are Triton kernels): set trainer.device cuda"
        )
    attention = attention or ATTN_IMPLEMENTATION
    if attention == ATTN_IMPLEMENTATION:
        from transformers.utils.import_utils import is_flash_attn_3_available

        if not is_flash_attn_3_available():
            raise RuntimeError(
                "trainer kernels `sglang` need FlashAttention-3 (flash_attn_interface) in the trainer "
                "image, as SGLang's `--attention-backend fa3` runs it: set spec.trainer.image to an image "
                "built by images/trainer-sglang.Dockerfile"
            )
    ops = load_ops() if ops is None else check_ops(ops)
    ops.enable_batch_invariant_mode(enable_bmm=False)
    exact.release_hub_kernels(model)
    install(model, device, attention)


def install(model: Any, device: torch.device | str, attention: str) -> None:
    """The module installs of `apply`, without its checks or SGLang's ops (which `apply` enables:
    without them the matmuls, means and log_softmax are torch's own, not batch-invariant)."""
    if attention == exact.ATTN_IMPLEMENTATION:
        exact.install_attention(model, device)
    base = model.model
    rope = RopeCache(model.config, torch.device(device))
    _install_embedding(base.embed_tokens)
    base.rotary_emb.forward = rope.cos_sin
    for layer in base.layers:
        _install_norm(layer.input_layernorm, out_bf16_input=False)
        _install_norm(layer.post_attention_layernorm, out_bf16_input=False)
        attn = layer.self_attn
        _install_norm(attn.q_norm, out_bf16_input=True)
        _install_norm(attn.k_norm, out_bf16_input=True)
        _install_attention(attn, rope)
        act: Any = layer.mlp.act_fn
        act.forward = torch.nn.functional.silu  # SiluAndMul.forward_native: F.silu(gate) * up
    _install_norm(base.norm, out_bf16_input=False)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            _install_linear(module)
    model.set_attn_implementation(attention)
    setattr(model, _APPLIED_ATTR, True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, bf16_input: bool) -> torch.Tensor:
    """SGLang's RMSNorm.forward_native with a float32 weight and `cast_x_before_out_mul` (float32 out).

    bf16_input: the q/k norms (input bf16, so the normed x is rounded to bf16 before the weight);
    otherwise the decoder and final norms (`override_orig_dtype=float32`).
    """
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(dim=-1, keepdim=True)  # SGLang's mean kernel under its mode
    normed = x32 * torch.rsqrt(variance + eps)
    w32 = weight.to(torch.float32)
    return w32 * normed.to(torch.bfloat16) if bf16_input else w32 * normed


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotary embedding, op for op as SGLang's `apply_rotary_emb` (x [N, H, D]; cos, sin [N, D/2])."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return torch.cat((o1, o2), dim=-1)


_ROTATE_COMPILED: Any = None


def compiled_rotate() -> Any:
    """`rotate` compiled as SGLang compiles its rotary function on the on-policy path (dynamic shapes):
    the compiled kernel's rounding (fused multiply-adds) is what the engine's q and k carry."""
    global _ROTATE_COMPILED
    if _ROTATE_COMPILED is None:
        _ROTATE_COMPILED = torch.compile(dynamic=True)(rotate)
    return _ROTATE_COMPILED


class RopeCache:
    """SGLang's float32 cos/sin cache of a Qwen3 config (rope_theta, head_dim, max positions)."""

    def __init__(self, config: Any, device: torch.device) -> None:
        params = getattr(config, "rope_parameters", None) or {}
        base = params.get("rope_theta", getattr(config, "rope_theta", 1000000))
        if params.get("rope_type", "default") != "default":
            raise ValueError(
                f"rope_type {params.get('rope_type')!r}: SGLang's on-policy Qwen3 path is the default RoPE"
            )
        dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        max_pos = int(getattr(config, "max_position_embeddings", 32768))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # on the CPU, as HF
        t = torch.arange(0, max_pos, dtype=torch.float, device=device)
        freqs = torch.einsum("i,j -> ij", t, inv_freq.to(device))
        self.cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_pos, D] float32
        self.head_dim = dim

    def cos_sin(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary module's forward: cos, sin [B, T, D/2] float32 at the positions."""
        picked = self.cache.index_select(0, position_ids.reshape(-1))
        cos, sin = picked.chunk(2, dim=-1)
        shape = (*position_ids.shape, self.head_dim // 2)
        return cos.reshape(shape), sin.reshape(shape)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """SGLang's on-policy sampled-token logprob: logits [N, V], ids [N], temperature [N] float32.

    `log_softmax(bf16(bf16(logits) / temperature))` (SGLang's batch-invariant log_softmax under its
    mode); returns [N] float32 (bf16 values, as the engine reports them)."""
    scaled = logits.bfloat16().div(temperature.to(torch.float32)[:, None]).bfloat16()
    logprobs = torch.log_softmax(scaled, dim=-1)
    return logprobs.gather(-1, ids[:, None])[:, 0].float()


def _install_embedding(embed: Any) -> None:
    m: Any = embed
    m.forward = lambda ids: torch.nn.functional.embedding(ids, m.weight).to(torch.float32)


def _install_norm(norm: Any, out_bf16_input: bool) -> None:
    m: Any = norm
    eps = float(getattr(m, "variance_epsilon", getattr(m, "eps", 1e-6)))
    m.forward = lambda x: rms_norm(x, m.weight, eps, bf16_input=out_bf16_input)


def _install_linear(linear: Any) -> None:
    m: Any = linear

    def forward(x: torch.Tensor) -> torch.Tensor:
        bias = None if m.bias is None else m.bias.to(torch.bfloat16)
        return torch.nn.functional.linear(x.to(torch.bfloat16), exact.weight_of(m).to(torch.bfloat16), bias)

    m.forward = forward


def _install_attention(attn: Any, rope: RopeCache) -> None:
    """Qwen3Attention.forward in SGLang's order: bf16 input, projections, q/k norms (float32 out),
    RoPE on float32 q/k, q/k to bf16, attention, o_proj."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    m: Any = attn
    d = rope.head_dim

    def forward(
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, None]:
        b, t = hidden_states.shape[:2]
        x = hidden_states.bfloat16()
        q = m.q_norm(m.q_proj(x).view(b, t, -1, d))  # float32
        k = m.k_norm(m.k_proj(x).view(b, t, -1, d))
        v = m.v_proj(x).view(b, t, -1, d)
        cos, sin = position_embeddings
        cos, sin = cos.expand(b, t, -1).reshape(b * t, -1), sin.expand(b, t, -1).reshape(b * t, -1)
        rot = compiled_rotate()
        q = rot(q.reshape(b * t, -1, d), cos, sin).to(torch.bfloat16).view(b, t, -1, d)
        k = rot(k.reshape(b * t, -1, d), cos, sin).to(torch.bfloat16).view(b, t, -1, d)
        fn = ALL_ATTENTION_FUNCTIONS[m.config._attn_implementation]
        out, _ = fn(
            m,
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attention_mask,
            dropout=0.0,
            scaling=m.scaling,
            sliding_window=getattr(m, "sliding_window", None),
        )  # [B, T, Hq, D]; no cache: the trainer scores whole sequences
        return m.o_proj(out.reshape(b, t, -1).contiguous()), None

    m.forward = forward
