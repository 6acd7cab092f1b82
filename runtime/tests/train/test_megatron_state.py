"""Offload stash and streamed optimizer state (lockstep.train.megatron.state), on CPU tensors.

The mechanisms are device-agnostic: a stash frees a tensor's storage and brings its bytes back; the
streamed step runs torch's AdamW bucket by bucket with the moments written to disk in between. On the
CPU we check what must hold on the GPU too: the bytes come back exactly, the storage is really gone
meanwhile, and a streamed AdamW trains to the same bits as a resident one. The GPU test checks the same
through the Megatron backend (test_megatron_gpu.py).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lockstep.train.common.batch import TrainBatch
from lockstep.train.megatron.state import Stash, StreamedOptimizerState, optimizer_tensors, resident


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_stash_frees_storage_and_restores_the_bytes(target: str, tmp_path: Path) -> None:
    base = torch.randn(1000, dtype=torch.float32)
    view = base[10:20]  # a view with an offset: the whole storage travels
    want = base.clone()
    stash = Stash(target, tmp_path / "s" if target == "disk" else None)  # type: ignore[arg-type]
    stash.put("a", view)
    assert not resident(base) and base.untyped_storage().nbytes() == 0
    stash.put("a", view)  # idempotent while away
    stash.take("a", view)
    assert torch.equal(base, want) and torch.equal(view, want[10:20])
    if target == "disk":
        assert (tmp_path / "s" / "a.bin").stat().st_size == 4000


def _adamw_run(streamed: StreamedOptimizerState | None, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (300, 50, 700, 10)]
    opt = torch.optim.AdamW(
        [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.99)
    )
    holder = SimpleNamespace(optimizer=opt)  # the shape of a megatron-core optimizer: .optimizer
    if streamed is not None:
        streamed.install(holder)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params]


def test_streamed_adamw_trains_to_the_same_bits(tmp_path: Path) -> None:
    streamed = StreamedOptimizerState(tmp_path / "opt", bucket_bytes=2 * 4 * 400)  # ~2 params per bucket
    resident_run = _adamw_run(None)
    streamed_run = _adamw_run(streamed)
    assert all(torch.equal(a, b) for a, b in zip(resident_run, streamed_run, strict=True))
    assert len(list((tmp_path / "opt").glob("*.bin"))) == 8  # two moments of four parameters on disk
    assert 0 < streamed.peak_resident_bytes <= 2 * 4 * 700  # one bucket's moments at a time at most


def test_streamed_moments_are_off_the_device_between_steps(tmp_path: Path) -> None:
    streamed = StreamedOptimizerState(tmp_path / "opt", bucket_bytes=1)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    opt = torch.optim.AdamW([p], lr=1e-2)
    holder = SimpleNamespace(optimizer=opt)
    streamed.install(holder)
    p.grad = torch.ones(64)
    opt.step()
    moments = [t for k, t in optimizer_tensors(holder, master=False)]
    assert len(moments) == 2 and not any(resident(t) for t in moments)
    key = streamed.key_of(opt, p, "exp_avg")
    assert torch.allclose(streamed.read(key, opt.state[p]["exp_avg"]), torch.full((64,), 0.1))


def test_padded_rows_train_nothing() -> None:
    batch = TrainBatch(
        input_ids=torch.tensor([[5, 6, 7], [5, 8, 0]]),
        attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
        loss_mask=torch.tensor([[0.0, 1.0], [1.0, 0.0]]),
        rollout_logprobs=torch.zeros(2, 2),
        advantages=torch.ones(2, 2),
        rewards=torch.tensor([1.0, 0.0]),
        routed_experts=[b"x", b"y"],
    )
    padded = batch.padded(5)
    assert padded.size == 5 and padded.num_tokens == batch.num_tokens
    assert torch.equal(padded.input_ids[2:], batch.input_ids[:1].expand(3, -1))
    assert (
        padded.advantages[2:].abs().sum() == 0
        and padded.rewards is not None
        and padded.rewards[2:].sum() == 0
    )
    assert padded.routed_experts == [b"x", b"y", None, None, None]
    assert batch.padded(2) is batch
