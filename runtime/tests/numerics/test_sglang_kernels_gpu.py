"""Trainer kernels `sglang` on CUDA: the trainer computes Qwen3 the way SGLang's on-policy path does.

SGLang itself cannot run here, so its own code is the oracle where it can run (sglang_source.py): its
batch-invariant Triton ops (matmul, log_softmax, mean) from the pinned wheel, enabled in this process
exactly as `--enable-deterministic-inference` enables them, and its rotary function. On a Qwen3-shaped
model (hidden 1024, GQA 16/8, head 128, vocab 151936; 4 layers, random bf16 weights, norm weights
not 1):

- the trainer's HF forward under `sglang_kernels.apply` gives the same logprob bits for every token
  whatever the batch: all rows at once, one at a time, shuffled pairs (right padding changes nothing);
- those bits equal a forward written from SGLang's Qwen3 model definition (qwen3.py / qwen2.py /
  layernorm.py / logits_processor.py / sampler.py of the pin): tokens flattened as one extend batch,
  fused qkv and gate_up projections, float32 embedding and residual, SGLang's RMSNorm forward_native,
  SGLang's own `apply_rotary_emb` compiled as SGLang compiles it, bf16 logits, the sampler's
  log_softmax of bf16(bf16(logits) / temperature);
- with SGLang's ops off (stock cuBLAS), the batch changes the bits (the check can fail);
- our compiled `rotate` equals SGLang's compiled `apply_rotary_emb`.

Attention is the one stand-in: the device has no FlashAttention-3 (SGLang's `--attention-backend fa3`
and the trainer's `flash_attention_3`), so both forwards here use the batch-invariant `lockstep_exact`
attention. FA3 is not verified by this file (docs/true-on-policy.md).

Run on the GPU machine: `pytest runtime/tests/numerics/test_sglang_kernels_gpu.py -m gpu -q`
(with LOCKSTEP_SGLANG_SOURCE pointing at the pinned wheel's sglang/ directory where it is not installed).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sglang_source
import torch
from lockstep.models.tiny import bigger_config
from lockstep.numerics import exact, sglang_kernels
from sglang_reference import by_batching, qwen3_model, score, sglang_forward_logprobs

pytestmark = pytest.mark.gpu

LENGTHS = (5, 17, 33, 64, 9, 40)


@pytest.fixture(scope="module")
def ops() -> Iterator[Any]:
    module = sglang_source.batch_invariant_ops()
    yield module
    module.disable_batch_invariant_mode()


def _model() -> Any:
    return qwen3_model(bigger_config(num_hidden_layers=4), "cuda")


@pytest.fixture(scope="module")
def model(ops: Any) -> Any:
    m = _model()
    sglang_kernels.apply(m, "cuda", ops=ops, attention=exact.ATTN_IMPLEMENTATION)
    return m


@pytest.fixture(scope="module")
def seqs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(10, 151000, (n,), generator=gen).cuda() for n in LENGTHS]


def _max_diff(runs: list[list[torch.Tensor]]) -> float:
    return max((a - b).abs().max().item() for other in runs[1:] for a, b in zip(runs[0], other, strict=True))


def test_trainer_forward_is_batch_invariant_under_sglang_ops(model: Any, seqs: list[torch.Tensor]) -> None:
    runs = by_batching(model, seqs)
    assert all(torch.equal(a, b) for other in runs[1:] for a, b in zip(runs[0], other, strict=True)), (
        _max_diff(runs)
    )


def test_without_sglang_ops_the_batch_changes_the_bits(ops: Any, seqs: list[torch.Tensor]) -> None:
    m = _model()  # no sglang_kernels: the HF forward on stock kernels
    ops.disable_batch_invariant_mode()
    try:
        runs = by_batching(m, seqs)
    finally:
        ops.enable_batch_invariant_mode(enable_bmm=False)
    assert _max_diff(runs) > 0


def test_trainer_forward_equals_sglangs_definition(model: Any, seqs: list[torch.Tensor]) -> None:
    with torch.no_grad():
        theirs = sglang_forward_logprobs(model, seqs, sglang_source.apply_rotary_emb())
    ours = score(model, seqs)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b), f"max diff {(a - b).abs().max().item()}"


def test_our_rotate_is_sglangs_compiled_rotary(ops: Any) -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(37, 16, 128, device="cuda", generator=gen)
    cos, sin = torch.randn(2, 37, 64, device="cuda", generator=gen)
    theirs = torch.compile(dynamic=True)(sglang_source.apply_rotary_emb())(x, cos, sin, True)
    assert torch.equal(sglang_kernels.compiled_rotate()(x, cos, sin), theirs)


def test_the_training_forward_backward_runs_under_sglang_ops(ops: Any, seqs: list[torch.Tensor]) -> None:
    # the trainer trains through the same installs (SGLang's mm also serves the backward matmuls)
    m = qwen3_model(bigger_config(num_hidden_layers=2), "cuda").train()
    sglang_kernels.apply(m, "cuda", ops=ops, attention=exact.ATTN_IMPLEMENTATION)
    ids = torch.nn.utils.rnn.pad_sequence(seqs[:3], batch_first=True)
    logits = m(input_ids=ids, attention_mask=(ids != 0).long()).logits
    flat = ids[:, 1:].reshape(-1)
    temp = torch.full((flat.numel(),), 0.7, device="cuda")
    lp = sglang_kernels.token_logprobs(logits[:, :-1].reshape(-1, logits.shape[-1]), flat, temp)
    lp.sum().backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert m.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_under_fsdp2_the_bits_do_not_change(model: Any, seqs: list[torch.Tensor]) -> None:
    # the FSDP backend wraps the installed model with fully_shard (one rank here): same bits
    import torch.distributed as dist
    from lockstep.train.common.dist import init_distributed
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    info = init_distributed("cuda")
    try:
        sharded = _model()
        sglang_kernels.apply(
            sharded, "cuda", ops=sglang_source.batch_invariant_ops(), attention=exact.ATTN_IMPLEMENTATION
        )
        mesh = init_device_mesh("cuda", (1,))
        for layer in sharded.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        for a, b in zip(score(sharded, seqs), score(model, seqs), strict=True):
            assert torch.equal(a, b), f"max diff {(a - b).abs().max().item()}"
    finally:
        if info.owns_group:
            dist.destroy_process_group()
