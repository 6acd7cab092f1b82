"""The FSDP2 backend on the real tiny Qwen3 checkpoint (gloo, world size 1; 2 ranks via torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lockstep.models import resolve_checkpoint
from lockstep.train.common.batch import TrainBatch
from lockstep.train.common.losses import sft_loss
from lockstep.train.common.packing import pack_sft
from lockstep.train.fsdp import FSDPBackend, FSDPConfig
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(resolve_checkpoint("builtin:tiny", cache_dir=tmp_path_factory.mktemp("cache")))


@pytest.fixture
def backend(model_dir: Path) -> Iterator[FSDPBackend]:
    b = FSDPBackend(FSDPConfig(model_path=model_dir, lr=1e-3, micro_batch_size=2, device="cpu"))
    yield b
    b.close()


def _batch(temperature: float = 1.0) -> TrainBatch:
    b = pack_sft(
        [([2, 20, 21, 3], [30, 31, 1]), ([2, 22, 3], [40, 41, 42, 1]), ([2, 23, 24, 25, 3], [50, 1])]
    )
    b.temperature = temperature
    return b


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_plain_hf_forward(backend: FSDPBackend, model_dir: Path, temperature: float) -> None:
    from transformers import AutoModelForCausalLM

    batch = _batch(temperature)
    got = backend.compute_logprobs(batch)  # [B, T-1], micro-batched over 2 rows
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = ref_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    want = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, batch.input_ids[:, 1:, None])[
        ..., 0
    ]
    mask = batch.loss_mask > 0
    assert torch.allclose(got[mask], want[mask], atol=1e-5)
    assert (got[~mask] == 0).all()


def test_export_names_match_the_hf_checkpoint(backend: FSDPBackend, model_dir: Path) -> None:
    exported = dict(backend.export_weights())
    on_disk = load_file(str(model_dir / "model.safetensors"))
    assert set(exported) == set(on_disk)
    for name, t in on_disk.items():
        assert torch.equal(exported[name], t), name  # loaded weights export bit-identically


def test_train_step_lowers_the_loss_and_counts_steps(backend: FSDPBackend) -> None:
    batch = _batch()
    first = backend.train_step(batch, sft_loss)
    for _ in range(4):
        last = backend.train_step(batch, sft_loss)
    assert not first.skipped and backend.step == 5
    assert first.tokens == batch.num_tokens == 9
    assert last.loss < first.loss


def test_non_finite_loss_skips_the_update(backend: FSDPBackend) -> None:
    before = {n: t.clone() for n, t in backend.export_weights()}

    def nan_loss(logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return logprobs * float("nan"), {}

    result = backend.train_step(_batch(), nan_loss)
    assert result.skipped and backend.step == 0
    for name, t in backend.export_weights():
        assert torch.equal(t, before[name]), name
    assert not backend.train_step(_batch(), sft_loss).skipped  # the optimizer is still usable


def test_save_load_resumes_exactly(model_dir: Path, tmp_path: Path) -> None:
    cfg = FSDPConfig(model_path=model_dir, lr=1e-2, device="cpu")
    a = FSDPBackend(cfg)
    b = FSDPBackend(cfg)
    try:
        batch = _batch()
        a.train_step(batch, sft_loss)
        a.save(tmp_path / "ck", extra={"version": 1})
        assert json.loads((tmp_path / "ck" / "trainer_state.json").read_text())["step"] == 1
        assert b.load(tmp_path / "ck") == {"version": 1} and b.step == 1
        # Same weights, same optimizer moments: the next step is identical on both.
        a.train_step(batch, sft_loss)
        b.train_step(batch, sft_loss)
        assert torch.equal(a.compute_logprobs(batch), b.compute_logprobs(batch))
    finally:
        b.close()
        a.close()


def test_load_refuses_an_incomplete_checkpoint(backend: FSDPBackend, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"incomplete: missing model\.safetensors"):
        backend.load(tmp_path)


def test_two_gloo_ranks_shard_train_and_save(model_dir: Path, tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m lockstep trainer`: real gloo collectives, FSDP2 sharding."""
    manifest = Path(__file__).parents[1] / "driver" / "fixtures" / "tiny-fast.yaml"
    out = tmp_path / "out"
    env = {**os.environ, "LOCKSTEP_CACHE": str(model_dir.parent), "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "lockstep", "trainer"]
    cmd += ["--config", str(manifest), "--out", str(out), "--sft-steps", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world size 2, 2 SFT steps" in proc.stdout
    saved = load_file(str(out / "model.safetensors"))
    original = load_file(str(model_dir / "model.safetensors"))
    assert set(saved) == set(original)
    assert any(not torch.equal(saved[n], original[n]) for n in saved)  # the sharded steps trained
    assert (out / "rng_rank0.pt").exists() and (out / "rng_rank1.pt").exists()


def test_reference_policy_stays_at_the_initial_weights(model_dir: Path) -> None:
    b = FSDPBackend(FSDPConfig(model_path=model_dir, lr=1e-2, device="cpu", with_ref=True))
    try:
        batch = _batch()
        assert torch.equal(b.compute_logprobs(batch, role="ref"), b.compute_logprobs(batch))
        b.train_step(batch, sft_loss)
        ref_after = b.compute_logprobs(batch, role="ref")
        assert not torch.equal(ref_after, b.compute_logprobs(batch))  # the actor moved, the reference did not
        assert b.ref_model is not None and all(not p.requires_grad for p in b.ref_model.parameters())
    finally:
        b.close()
    plain = FSDPBackend(FSDPConfig(model_path=model_dir, device="cpu"))
    try:
        with pytest.raises(ValueError, match="with_ref=True"):
            plain.compute_logprobs(_batch(), role="ref")
    finally:
        plain.close()
