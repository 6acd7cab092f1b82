"""A Qwen3 forward written from SGLang's model definition, and the trainer-side scoring to compare with it.

Why it exists: the tests of trainer kernels `sglang` (lockstep.numerics.sglang_kernels) check the
trainer's HF forward against what stock SGLang computes for Qwen3 dense on its on-policy path. SGLang
cannot run here, so `sglang_forward_logprobs` is that computation written from the pinned SGLang's
qwen3.py / qwen2.py / layernorm.py / rotary_embedding / logits_processor.py / sampler.py (the facts
runtime/tests/sglang/test_true_on_policy_contract.py checks against the wheel): the sequences as one
flattened extend batch, fused qkv and gate_up projections, float32 embedding and residual stream,
RMSNorm.forward_native with float32 weights, RoPE from a float32 cos/sin cache through SGLang's own
`apply_rotary_emb` (passed in) compiled as SGLang compiles it, bf16 logits, the sampler's
log_softmax of bf16(bf16(logits) / temperature). Attention is the one stand-in both sides share: the
batch-invariant `lockstep_exact` kernel (SGLang's FA3 does not run on these machines).
"""

from __future__ import annotations

import random
from typing import Any

import torch
from lockstep.numerics import exact, kernels, sglang_kernels

TEMPERATURE = 0.7


def qwen3_model(config: Any, device: str) -> Any:
    """A random bf16 Qwen3ForCausalLM whose norm weights are not 1 (so their dtype handling shows)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(device, torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model.eval()


def score(model: Any, rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per row, the trainer's logprob of tokens 1..n-1 (a right-padded batch through the HF forward)."""
    dev = rows[0].device
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits  # [B, T, V]
    b, t, v = logits.shape
    flat_ids = ids[:, 1:].reshape(-1)
    temp = torch.full((flat_ids.numel(),), TEMPERATURE, dtype=torch.float32, device=dev)
    lp = sglang_kernels.token_logprobs(logits[:, :-1].reshape(-1, v), flat_ids, temp).view(b, t - 1)
    return [lp[i, : len(r) - 1] for i, r in enumerate(rows)]


def by_batching(model: Any, seqs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`score` of every sequence under three batchings: all at once (shuffled), one at a time, pairs."""
    order = list(range(len(seqs)))
    random.Random(0).shuffle(order)
    out = []
    for batching in ([order], [[i] for i in order], [order[i : i + 2] for i in range(0, len(order), 2)]):
        got: dict[int, torch.Tensor] = {}
        for group in batching:
            for i, lp in zip(group, score(model, [seqs[i] for i in group]), strict=True):
                got[i] = lp
        out.append([got[i] for i in range(len(seqs))])
    return out


def _norm(
    x: torch.Tensor, w: torch.Tensor, eps: float, orig: torch.dtype, residual: torch.Tensor | None = None
) -> Any:
    """layernorm.py RMSNorm.forward_native with weight_dtype float32 and cast_x_before_out_mul=True;
    orig float32 for the decoder and final norms (override_orig_dtype, fp32_residual)."""
    x = x.to(torch.float32)
    if residual is not None:
        x = x + residual.to(torch.float32)
        residual = x.clone()
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    x = w.to(torch.float32) * x.to(orig)
    return x if residual is None else (x, residual)


def sglang_forward_logprobs(
    model: Any, seqs: list[torch.Tensor], apply_rotary_emb: Any
) -> list[torch.Tensor]:
    """Per sequence, the logprob of tokens 1..n-1 as SGLang's Qwen3 computes it (see the module doc),
    from `model`'s weights."""
    dev = seqs[0].device
    cfg = model.config
    base = model.model
    d = cfg.head_dim
    eps = cfg.rms_norm_eps
    n_all = sum(len(s) for s in seqs)
    ids = torch.cat(seqs)  # one extend batch, [N]
    positions = torch.cat([torch.arange(len(s), device=dev) for s in seqs])
    params = getattr(cfg, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 1000000))
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))  # CPU (_force_native)
    t = torch.arange(0, cfg.max_position_embeddings, dtype=torch.float, device=dev)
    freqs = torch.einsum("i,j -> ij", t, inv_freq.to(dev))
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    rope = torch.compile(dynamic=True)(apply_rotary_emb)

    hidden = torch.nn.functional.embedding(ids, base.embed_tokens.weight.float())  # params_dtype float32
    residual: torch.Tensor | None = None
    for layer in base.layers:
        a, mlp = layer.self_attn, layer.mlp
        if residual is None:
            x, residual = _norm(hidden, layer.input_layernorm.weight, eps, torch.float32), hidden
        else:
            x, residual = _norm(hidden, layer.input_layernorm.weight, eps, torch.float32, residual)
        x = x.bfloat16()  # Qwen3Attention.forward
        qkv = torch.nn.functional.linear(x, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        nq, nkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        q = _norm(q.reshape(-1, d), a.q_norm.weight, eps, torch.bfloat16)  # apply_qk_norm, float32 out
        k = _norm(k.reshape(-1, d), a.k_norm.weight, eps, torch.bfloat16)
        q = rope(q.view(n_all, -1, d), cos, sin, True).to(torch.bfloat16)
        k = rope(k.view(n_all, -1, d), cos, sin, True).to(torch.bfloat16)
        outs, start = [], 0
        for s in seqs:  # the stand-in attention, causal, one sequence at a time
            n = len(s)
            qs = q[start : start + n].view(1, n, -1, d).transpose(1, 2)
            ks = k[start : start + n].view(1, n, -1, d).transpose(1, 2)
            vs = v[start : start + n].reshape(1, n, -1, d).transpose(1, 2)
            visible = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
            o = kernels.attention(qs, ks, vs, visible, a.scaling, exact.tiles_for(dev))
            outs.append(o.transpose(1, 2).reshape(n, -1))
            start += n
        hidden = torch.nn.functional.linear(torch.cat(outs), a.o_proj.weight)
        x, residual = _norm(hidden, layer.post_attention_layernorm.weight, eps, torch.float32, residual)
        x = x.bfloat16()  # Qwen2MLP.forward
        gate_up = torch.nn.functional.linear(x, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        half = gate_up.shape[-1] // 2
        act = torch.nn.functional.silu(gate_up[..., :half]) * gate_up[..., half:]  # SiluAndMul.forward_native
        hidden = torch.nn.functional.linear(act, mlp.down_proj.weight)
    h, _ = _norm(hidden, base.norm.weight, eps, torch.float32, residual)
    logits = torch.matmul(h.bfloat16(), model.lm_head.weight.T.bfloat16())  # logits_processor.py
    temps = torch.full((n_all, 1), TEMPERATURE, dtype=torch.float32, device=dev)
    logprobs = torch.log_softmax(logits.bfloat16().div(temps).bfloat16(), dim=-1)  # sampler.py
    picked, start = [], 0
    for s in seqs:
        n = len(s)
        picked.append(logprobs[start : start + n - 1].gather(-1, s[1:, None])[:, 0].float())
        start += n
    return picked
