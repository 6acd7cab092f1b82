"""The batch-invariant kernels alone: a row's result never depends on the rows, keys or padding
around it, and stays close to torch's own result. (The stock path fails the first property end to
end: test_true_on_policy.py's mode-off tests.)"""

from __future__ import annotations

import pytest
import torch
from lockstep.numerics import kernels
from lockstep.numerics.exact import CPU_TILES

T = CPU_TILES


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    w = torch.randn(200, 150, generator=_g(0)).to(dtype)  # K, N not multiples of the tiles
    x = torch.randn(70, 150, generator=_g(1)).to(dtype)
    full = kernels.linear(x, w, None, T)
    for rows in ([0], [5, 6, 7], list(range(17)), [69, 3]):
        assert torch.equal(kernels.linear(x[rows], w, None, T), full[rows])
    torch.testing.assert_close(full.float(), (x.float() @ w.float().T), rtol=2e-2, atol=2e-2)


def test_batched_matmul_is_invariant_per_batch_entry() -> None:
    a = torch.randn(6, 9, 33, generator=_g(2))
    b = torch.randn(6, 33, 21, generator=_g(3))
    full = kernels.matmul(a, b, T)
    assert torch.equal(kernels.matmul(a[2:3, 4:5], b[2:3], T), full[2:3, 4:5])
    torch.testing.assert_close(full, a @ b, rtol=1e-5, atol=1e-5)


def test_rowsum_ignores_trailing_zeros() -> None:
    x = torch.randn(5, 100, generator=_g(4))
    padded = torch.cat([x, torch.zeros(5, 157)], dim=-1)
    assert torch.equal(kernels.rowsum(x, T), kernels.rowsum(padded, T))


def test_pointwise_does_not_depend_on_position() -> None:
    x = torch.randn(9000, generator=_g(5)) * 8
    whole = kernels.silu(x, T)
    assert torch.equal(
        torch.stack([kernels.silu(x[i : i + 1], T)[0] for i in range(0, 9000, 97)]), whole[::97]
    )


def test_attention_over_a_longer_cache_or_padding_is_the_same() -> None:
    q = torch.randn(2, 4, 19, 16, generator=_g(6))
    k = torch.randn(2, 2, 19, 16, generator=_g(7))
    v = torch.randn(2, 2, 19, 16, generator=_g(8))
    causal = torch.arange(19)[None, :] <= torch.arange(19)[:, None]
    full = kernels.attention(q, k, v, causal, 0.25, T)  # the trainer: every query at once
    torch.testing.assert_close(
        full, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)
    )
    for t in (0, 7, 18):  # the engine: one query over a cache of t + 1 keys, plus stale keys masked off
        stale = torch.randn(1, 2, 13, 16, generator=_g(t))
        keys, values = torch.cat([k[1:, :, : t + 1], stale], 2), torch.cat([v[1:, :, : t + 1], stale], 2)
        visible = (torch.arange(t + 14) <= t)[None, None, None, :]
        one = kernels.attention(q[1:, :, t : t + 1], keys, values, visible, 0.25, T)
        assert torch.equal(one, full[1:, :, t : t + 1])


def test_token_logprobs_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(12, 300, generator=_g(9)) * 3
    ids = torch.randint(0, 300, (12,), generator=_g(10))
    temp = torch.full((12,), 0.7)
    full = kernels.token_logprobs(logits, ids, temp, T)
    assert torch.equal(kernels.token_logprobs(logits[4:5], ids[4:5], temp[4:5], T), full[4:5])
    ref = torch.log_softmax(logits / 0.7, dim=-1).gather(1, ids[:, None])[:, 0]
    torch.testing.assert_close(full, ref)
