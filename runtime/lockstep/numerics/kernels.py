"""Batch-invariant kernels: every output element is computed the same way whatever the batch around it.

Why it exists: true on-policy (§4.3) needs the engine, which decodes one token of many sequences
at a time over a KV cache, and the trainer, which scores whole padded sequences, to produce
bit-identical logprobs. Stock kernels do not: a matmul picks its algorithm (and its reduction order)
from the shape, so a row's result depends on how many rows came with it; a CPU pointwise kernel runs
the vectorized body and a scalar tail with different code (silu/exp differ in the last bit); a
reduction splits its work by the number of outputs. Here each of these is rebuilt so that the
arithmetic of one output element depends only on its own inputs:

- `matmul`: the operands are cut into fixed tiles (rows x inner x cols); every product is a batched
  matmul of exactly `Tiles.group` tiles of one shape (the last call is padded with zero tiles), and the
  partial sums over the inner tiles are added in a fixed order. Trailing zero tiles (padding, or keys
  masked out of attention) add exact zeros, so a longer KV cache or a longer padded row changes nothing.
- `rowsum`: a reduction over the last axis is a `matmul` with a column of ones (one-column tiles).
- `pointwise`: on CPU a transcendental function runs on fixed-size contiguous chunks (one thread, no
  scalar tail); CUDA pointwise kernels compute each element alike already.
- `attention`, `rms_norm`, `silu`, `rope`, `token_logprobs` are built only from the above and from
  correctly rounded IEEE operations (+, -, *, /, sqrt, max), in one order on both sides.

Cost: padding to tiles and many small matmuls (bench/true_on_policy_throughput.py measures it).
Who calls it: lockstep.numerics.exact (which installs these into HF modules) and the reference
engine's runner; docs/true-on-policy.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Callable


@dataclass(frozen=True, slots=True)
class Tiles:
    """Fixed tile shapes of `matmul` (a profile's kernel settings; both sides must use the same)."""

    rows: int = 16
    """Rows of the left operand per tile."""
    inner: int = 64
    """Contraction length per tile; partial sums over inner tiles are added in order."""
    cols: int = 64
    """Columns of the right operand per tile."""
    group: int = 64
    """Tiles per batched matmul call (the last call is padded with zero tiles)."""
    chunk: int = 4096
    """Elements per pointwise call on CPU: a multiple of every SIMD width and below torch's
    parallel grain size, so each chunk runs on one thread with no scalar tail."""


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


def _tile(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[P, M, N] -> zero-padded tiles [P, Mt, Nt, rows, cols] (contiguous)."""
    p, m, n = x.shape
    x = torch.nn.functional.pad(x, (0, _ceil(n, cols) - n, 0, _ceil(m, rows) - m))
    mt, nt = x.shape[1] // rows, x.shape[2] // cols
    return x.view(p, mt, rows, nt, cols).permute(0, 1, 3, 2, 4).contiguous()


def matmul(a: torch.Tensor, b: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    """Batch-invariant a @ b in float32: a [..., M, K], b [K, N] or [..., K, N] -> [..., M, N].

    Leading dims of a and b must be equal when b has them. The result of row m, column n depends only
    on a[..., m, :] and b[..., :, n] (see the module doc).
    """
    lead = a.shape[:-2]
    m, k = a.shape[-2:]
    n = b.shape[-1]
    a3 = a.reshape(-1, m, k).float()  # [P, M, K]
    shared = b.dim() == 2
    b3 = (b if shared else b.reshape(-1, k, n)).float().reshape(-1, k, n)  # [1 or P, K, N]
    at = _tile(a3, tiles.rows, tiles.inner)  # [P, Mt, Kt, R, KB]
    bt = _tile(b3, tiles.inner, tiles.cols)  # [Pb, Kt, Nt, KB, NB]
    p, mt, kt = at.shape[:3]
    nt = bt.shape[2]
    lhs_tiles = at.view(-1, tiles.rows, tiles.inner)  # [P*Mt*Kt, R, KB]
    rhs_tiles = bt.view(-1, tiles.inner, tiles.cols)  # [Pb*Kt*Nt, KB, NB]
    acc: torch.Tensor | None = None
    for groups in _plan(p, mt, kt, nt, shared, tiles.group, a.device):  # inner tiles, in this order
        outs = [
            torch.bmm(lhs_tiles.index_select(0, li), rhs_tiles.index_select(0, ri))[:count]  # [<=G, R, NB]
            for li, ri, count in groups
        ]
        part = torch.cat(outs)  # [P*Mt*Nt, R, NB]
        acc = part if acc is None else acc + part
    assert acc is not None
    out = acc.view(p, mt, nt, tiles.rows, tiles.cols).permute(0, 1, 3, 2, 4)  # [P, Mt, R, Nt, NB]
    out = out.reshape(p, mt * tiles.rows, nt * tiles.cols)[:, :m, :n]
    return out.reshape(*lead, m, n)


_Plan = list[list[tuple[torch.Tensor, torch.Tensor, int]]]
_PLANS: dict[tuple[int, int, int, int, bool, int, torch.device], _Plan] = {}


def _plan(p: int, mt: int, kt: int, nt: int, shared: bool, g: int, dev: torch.device) -> _Plan:
    """Per inner tile k, the groups of exactly `g` output tiles (p, m, n) in order, as flat indices
    into the lhs tiles [P*Mt*Kt] and the rhs tiles [Pb*Kt*Nt] (the last group padded by repeating its
    final tile), with each group's real count. Cached per shape (small; bounded by the context length)."""
    key = (p, mt, kt, nt, shared, g, dev)
    plan = _PLANS.get(key)
    if plan is None:
        # Normal tensors even when first built under inference_mode (the engine): the trainer in the
        # same process indexes with them under autograd.
        with torch.inference_mode(False):
            pi = torch.arange(p, device=dev).repeat_interleave(mt * nt)
            mi = torch.arange(mt, device=dev).repeat_interleave(nt).repeat(p)
            ni = torch.arange(nt, device=dev).repeat(p * mt)
            bi = torch.zeros_like(pi) if shared else pi
            lhs, rhs = (pi * mt + mi) * kt, bi * kt * nt + ni  # tile k = 0
            total = pi.numel()
            plan = []
            for ki in range(kt):
                groups = []
                for s in range(0, total, g):
                    idx = torch.arange(s, s + g, device=dev).clamp_(max=total - 1)
                    groups.append((lhs[idx] + ki, rhs[idx] + ki * nt, min(g, total - s)))
                plan.append(groups)
        _PLANS[key] = plan  # never evicted: a captured CUDA graph may point at these tensors
    return plan


def rowsum(x: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    """Batch-invariant sum over the last axis in float32: [..., K] -> [..., 1]."""
    k = x.shape[-1]
    ones = torch.ones(k, 1, dtype=torch.float32, device=x.device)
    flat = x.reshape(-1, k)  # [M, K]
    return matmul(flat, ones, replace(tiles, cols=1)).reshape(*x.shape[:-1], 1)


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    """fn applied elementwise so that each element's result does not depend on its position.

    On CPU: fixed-size contiguous chunks, each on one thread with no scalar tail (fn must be a
    pointwise torch function). Elsewhere fn(x) as is.
    """
    if x.device.type != "cpu":
        return fn(x)
    flat = x.contiguous().view(-1)
    n = flat.numel()
    c = tiles.chunk
    padded = torch.nn.functional.pad(flat, (0, _ceil(max(n, 1), c) - n))
    parts = [fn(padded[i : i + c]) for i in range(0, padded.numel(), c)]  # each a contiguous [c] view
    return torch.cat(parts)[:n].view(x.shape)


def exp(x: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    return pointwise(torch.exp, x, tiles)


def log(x: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    return pointwise(torch.log, x, tiles)


def silu(x: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    """x * sigmoid(x) as x / (1 + exp(-x)), in x's dtype (the exp is the invariant one)."""
    return x / (1.0 + exp(-x, tiles))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: Tiles) -> torch.Tensor:
    """F.linear, batch-invariant: x [..., K] @ weight[N, K]^T (+ bias), computed in float32, returned
    in x's dtype."""
    out = matmul(x.reshape(-1, x.shape[-1]), weight.t(), tiles)  # [M, N] float32
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0]).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, tiles: Tiles) -> torch.Tensor:
    """Qwen3's RMSNorm (float32 statistics, weight applied in x's dtype), batch-invariant."""
    x32 = x.float()
    var = rowsum(x32 * x32, tiles) / x.shape[-1]  # [..., 1]
    normed = x32 * (1.0 / torch.sqrt(var + eps))
    return weight * normed.to(x.dtype)


def rope(
    inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float, tiles: Tiles
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, D] (float32) of the positions [B, T] for inv_freq [D/2], as HF's rotary
    embedding computes them (attention_scaling applied), position by position."""
    freqs = positions[..., None].float() * inv_freq.float()  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    return pointwise(torch.cos, emb, tiles) * scaling, pointwise(torch.sin, emb, tiles) * scaling


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scaling: float,
    tiles: Tiles,
) -> torch.Tensor:
    """Softmax attention, batch-invariant and invariant to masked or padded keys.

    q [B, Hq, T, D]; k, v [B, Hkv, S, D] (Hq a multiple of Hkv); visible: bool, broadcastable to
    [B, Hq, T, S], True where a query may see a key. Returns [B, Hq, T, D] in q's dtype. Scores, max,
    exp and the sums run in float32; keys a query cannot see contribute exact zeros.
    """
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)  # [B, Hq, S, D]
        v = v.repeat_interleave(rep, dim=1)
    scores = matmul(q, k.transpose(-1, -2), tiles) * scaling  # [B, Hq, T, S] float32
    scores = scores.masked_fill(~visible, -math.inf)
    top = scores.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)  # rows with no key
    p = exp(scores - top, tiles)  # exactly 0 where masked
    probs = p / rowsum(p, tiles).clamp(min=torch.finfo(torch.float32).tiny)
    return matmul(probs, v.float(), tiles).to(q.dtype)  # [B, Hq, T, D]


def token_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor, tiles: Tiles
) -> torch.Tensor:
    """log softmax(logits / temperature)[id] per row, batch-invariant: logits [N, V], ids [N],
    temperature [N] (a tensor on both sides: a scalar divisor may become a multiply by its inverse).
    Returns [N] float32."""
    scaled = logits.float() / temperature.float()[:, None]  # [N, V]
    top = scaled.amax(dim=-1, keepdim=True)  # [N, 1]
    shifted = scaled - top
    lse = log(rowsum(exp(shifted, tiles), tiles), tiles)  # [N, 1]
    return (shifted.gather(-1, ids[:, None]) - lse)[:, 0]
