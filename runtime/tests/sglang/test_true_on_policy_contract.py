"""SGLang as the oracle of trainer kernels `sglang`: every fact lockstep.numerics.sglang_kernels relies on,
read from the pinned wheel's source.

The trainer reproduces what stock SGLang computes for Qwen3 dense under `--enable-deterministic-inference
--rl-on-policy-target fsdp` (docs/true-on-policy.md). Each row below is one of those facts, as the
statement SGLang's source makes it (whitespace-insensitive) inside the function or class that runs it.
A moved pin that changes one fails here, naming what the trainer would then compute differently.
The files are read, not imported (most of them import CUDA kernels).
"""

from __future__ import annotations

import ast
import functools
import re

import pytest
from lockstep.api.profiles import SGLANG_TRUE_ON_POLICY_ENV
from lockstep.numerics import sglang_kernels
from sglang_oracle import require_pinned_sglang, source


@pytest.fixture(autouse=True)
def _sglang() -> None:
    require_pinned_sglang()


def _flat(text: str) -> str:
    return re.sub(r"\s+", "", text)


@functools.cache
def _segment(relative: str, qualname: str) -> str:
    """The source of `Class.method` / `function` / `Class` in a file of the installed sglang."""
    text = source(relative).read_text()
    node: ast.AST = ast.parse(text)
    for part in qualname.split("."):
        node = next(
            n
            for n in ast.iter_child_nodes(node)
            if isinstance(n, ast.ClassDef | ast.FunctionDef) and n.name == part
        )
    segment = ast.get_source_segment(text, node)
    assert segment is not None
    return _flat(segment)


FACTS = [
    # (file, where, SGLang's statement, what the trainer does because of it)
    (
        "srt/models/qwen3.py",
        "Qwen3DecoderLayer.__init__",
        "dict(weight_dtype=torch.float32,cast_x_before_out_mul=True,override_orig_dtype=torch.float32,fp32_residual=True,)"
        "ifget_exec().deterministic.rl_on_policy_target",
        "decoder norms: float32 weight, float32 out, float32 residual stream",
    ),
    (
        "srt/models/qwen3.py",
        "Qwen3Attention.__init__",
        "dict(weight_dtype=torch.float32,cast_x_before_out_mul=True,)ifget_exec().deterministic.rl_on_policy_target",
        "q/k norms: float32 weight times bf16(normed x)",
    ),
    (
        "srt/models/qwen3.py",
        "Qwen3Attention.forward",
        "ifget_exec().deterministic.rl_on_policy_targetisnotNone:hidden_states=hidden_states.bfloat16()",
        "attention input cast to bf16",
    ),
    (
        "srt/models/qwen3.py",
        "Qwen3Attention.forward",
        "q=q.to(torch.bfloat16)k=k.to(torch.bfloat16)",
        "q, k to bf16 after RoPE",
    ),
    (
        "srt/models/qwen3.py",
        "Qwen3Attention.forward_prepare_native",
        "q,k=apply_qk_norm(",
        "q/k norms before RoPE",
    ),
    (
        "srt/models/qwen2.py",
        "Qwen2Model.__init__",
        "params_dtype=(torch.float32ifget_exec().deterministic.rl_on_policy_targetisnotNoneelseNone)",
        "float32 embedding table",
    ),
    (
        "srt/models/qwen2.py",
        "Qwen2Model.__init__",
        "dict(weight_dtype=torch.float32,cast_x_before_out_mul=True,override_orig_dtype=torch.float32,fp32_residual=True,)",
        "final norm: float32 out",
    ),
    (
        "srt/models/qwen2.py",
        "Qwen2MLP.forward",
        "ifget_exec().deterministic.rl_on_policy_targetisnotNone:x=x.bfloat16()",
        "MLP input cast to bf16",
    ),
    (
        "srt/layers/layernorm.py",
        "RMSNorm.forward_cuda",
        "ifis_batch_invariant_mode_enabled():if(residualisnotNoneorself.cast_x_before_out_mulor"
        'get_exec().deterministic.rl_on_policy_target=="fsdp"):returnself.forward_native(',
        "RMSNorm runs forward_native",
    ),
    (
        "srt/layers/layernorm.py",
        "RMSNorm.forward_native",
        "variance=x_var.pow(2).mean(dim=-1,keepdim=True)x=x*torch.rsqrt(variance+self.variance_epsilon)"
        "ifself.cast_x_before_out_mul:x=self.weight*x.to(orig_dtype)",
        "x32 * rsqrt(mean(x32^2) + eps), weight times x in orig dtype",
    ),
    (
        "srt/layers/layernorm.py",
        "RMSNorm.forward_native",
        "x=x+residual.to(torch.float32)",
        "residual added in float32",
    ),
    (
        "srt/layers/rotary_embedding/base.py",
        "RotaryEmbedding.__init__",
        "ifself._force_nativeor_is_musa:self._forward_method=self.forward_native"
        "self._apply_rotary_emb_wrapped=torch.compile(dynamic=True,disable=_is_npu,)(apply_rotary_emb)",
        "RoPE: the native formula compiled with dynamic shapes",
    ),
    (
        "srt/layers/rotary_embedding/base.py",
        "RotaryEmbedding._compute_inv_freq",
        'init_device="cpu"ifself._force_nativeelseNone',
        "inv_freq computed on the CPU",
    ),
    (
        "srt/layers/rotary_embedding/base.py",
        "RotaryEmbedding._compute_cos_sin_cache",
        'freqs=torch.einsum("i,j->ij",t,inv_freq)cos=freqs.cos()sin=freqs.sin()cache=torch.cat((cos,sin),dim=-1)',
        "float32 cos/sin cache",
    ),
    (
        "srt/layers/activation.py",
        "SiluAndMul.forward_native",
        "returnF.silu(x[...,:d])*x[...,d:]",
        "silu(gate) * up in the activation dtype",
    ),
    (
        "srt/layers/activation.py",
        "SiluAndMul.__init__",
        "get_exec().deterministic.rl_on_policy_targetisnotNone):self._forward_method=self.forward_native",
        "the native activation on the on-policy path",
    ),
    (
        "srt/layers/logits_processor.py",
        "LogitsProcessor._compute_lm_head",
        "elifself.rl_on_policy_targetisnotNone:#Duetotie-weight,wemaynotbeabletochangelm_head'sweightdtype"
        "logits=torch.matmul(hidden_states.bfloat16(),lm_head.weight.T.bfloat16())",
        "logits = bf16(h) @ bf16(W)^T",
    ),
    (
        "srt/layers/sampler.py",
        "Sampler.forward",
        "logits_div_temperature=(logits.bfloat16().div(sampling_info.temperatures).bfloat16())"
        "logprobs_via_logsoftmax_kernel=torch.log_softmax(logits_div_temperature,dim=-1)",
        "logprob = log_softmax(bf16(bf16(logits) / temperature))",
    ),
    (
        "srt/batch_invariant_ops/batch_invariant_ops.py",
        "enable_batch_invariant_mode",
        '_batch_invariant_LIB.impl("aten::mm",mm_batch_invariant,dispatch_key)',
        "batch-invariant mm",
    ),
    (
        "srt/batch_invariant_ops/batch_invariant_ops.py",
        "enable_batch_invariant_mode",
        '_batch_invariant_LIB.impl("aten::_log_softmax",_log_softmax_batch_invariant,dispatch_key)',
        "batch-invariant log_softmax",
    ),
    (
        "srt/batch_invariant_ops/batch_invariant_ops.py",
        "enable_batch_invariant_mode",
        '_batch_invariant_LIB.impl("aten::mean.dim",mean_batch_invariant,dispatch_key)',
        "batch-invariant mean",
    ),
    (
        "srt/model_executor/model_runner.py",
        "ModelRunner.maybe_enable_batch_invariant_mode",
        "ifget_exec().deterministic.enable_deterministic_inference:"
        "fromsglang.srt.batch_invariant_opsimportenable_batch_invariant_modeenable_batch_invariant_mode()",
        "the engine enables the same ops module",
    ),
    (
        "srt/layers/attention/flashattention_backend.py",
        "FlashAttentionBackend.__init__",
        "self.num_splits=1ifdeterministicelse0",
        "FA3 with one split",
    ),
]


@pytest.mark.parametrize(("relative", "where", "statement", "why"), FACTS, ids=[f[3] for f in FACTS])
def test_sglang_computes_what_the_trainer_reproduces(
    relative: str, where: str, statement: str, why: str
) -> None:
    assert _flat(statement) in _segment(relative, where), f"{relative} {where} no longer says: {why}"


def test_a_statement_sglang_does_not_make_fails() -> None:
    # the check can fail: the q/k norms with a bf16 weight are not what SGLang states
    assert _flat("dict(weight_dtype=torch.bfloat16,cast_x_before_out_mul=True,)") not in _segment(
        "srt/models/qwen3.py", "Qwen3Attention.__init__"
    )


def test_fsdp_is_sglangs_only_on_policy_target() -> None:
    # no tensor-parallel target in the pin: rule true-on-policy-sglang-one-gpu-per-layer
    text = _flat(source("srt/arg_groups/choices.py").read_text())
    assert 'RL_ON_POLICY_TARGET_CHOICES=["fsdp"]' in text


def test_the_deepgemm_switch_is_the_one_sglangs_ops_read() -> None:
    text = _flat(source("srt/batch_invariant_ops/batch_invariant_ops.py").read_text())
    assert f'_ENABLE_MM_DEEPGEMM=get_bool_env_var("{sglang_kernels.DEEPGEMM_SWITCH}","1")' in text
    assert SGLANG_TRUE_ON_POLICY_ENV == {sglang_kernels.DEEPGEMM_SWITCH: "0"}
