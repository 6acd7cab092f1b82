"""The Megatron backend on a GPU: same numbers as FSDP, R3 through megatron-core's router, offload,
streaming, checkpoints, and a learning RL run with the reference engine on CUDA (marked gpu).

Tolerances. In float32 both backends compute the same function with different kernels (megatron-core's
attention, torch's RMSNorm, its RoPE): logprobs agree to 1e-4. In bf16 each backend rounds every
intermediate to 8 mantissa bits, so the two are two independent bf16 approximations of the same fp32
function: we measure how far FSDP's own bf16 forward is from its fp32 forward on the same batch (the
bf16 noise floor, about 1e-2 per token for these models) and require Megatron-bf16 vs FSDP-bf16 to stay
within 2x that floor on average (two independent errors of that size differ by about sqrt(2) of it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lockstep.models.tiny import materialize_builtin
from lockstep.train.common.batch import TrainBatch
from lockstep.train.common.losses import PolicyLossConfig, policy_loss
from lockstep.train.common.r3 import encode_routed_experts

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialize_builtin("builtin:tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialize_builtin("builtin:tiny-moe", tmp_path_factory.mktemp("tinymoe"), seed=0)


def _bf16_copy(src: Path, dst: Path) -> Path:
    """The same checkpoint with bf16 weights (what real checkpoints hold; disk-delta needs equal dtypes)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    save_file(
        {k: v.to(torch.bfloat16) for k, v in weights.items()},
        str(dst / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config = json.loads((dst / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _batch(
    rows: int = 6, length: int = 24, vocab: int = 96, seed: int = 0, moe_layers: int = 0
) -> TrainBatch:
    """Right-padded rows of varied lengths; half of each row is 'response' (trained)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, vocab, (rows, length), generator=g)
    lengths = [length - (i * 3) % 9 for i in range(rows)]
    mask = torch.zeros(rows, length, dtype=torch.long)
    loss = torch.zeros(rows, length - 1)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        ids[i, n:] = 0
        loss[i, n // 2 : n - 1] = 1.0
    adv = torch.randn(rows, 1, generator=g).expand(rows, length - 1) * loss
    routed: list[bytes | None] = []
    if moe_layers:
        for n in lengths:  # random distinct experts per token and layer: nothing like the trainer's own
            picks = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range((n - 1) * moe_layers)])
            routed.append(encode_routed_experts(picks.view(n - 1, moe_layers, 2)))
    return TrainBatch(
        input_ids=ids,
        attention_mask=mask,
        loss_mask=loss,
        rollout_logprobs=torch.full((rows, length - 1), -2.0) * loss,
        advantages=adv.contiguous(),
        temperature=0.8,
        routed_experts=routed,
    )


def _megatron(path: Path, **kw: Any) -> Any:
    from lockstep.train.megatron import MegatronConfig
    from lockstep.train.megatron.backend import MegatronBackend

    return MegatronBackend(MegatronConfig(model_path=path, micro_batch_size=4, lr=1e-2, **kw))


def _fsdp(path: Path, **kw: Any) -> Any:
    from lockstep.train.fsdp import FSDPBackend, FSDPConfig

    return FSDPBackend(FSDPConfig(model_path=path, micro_batch_size=4, lr=1e-2, device="cuda", **kw))


@pytest.fixture
def backends() -> Iterator[list[Any]]:
    """Backends made by a test, closed newest first (the first one owns the process group)."""
    made: list[Any] = []
    yield made
    for b in reversed(made):
        b.close()


def _loss() -> Any:
    return partial(policy_loss, config=PolicyLossConfig())


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_logprobs_match_fsdp(which: str, dense_dir: Path, moe_dir: Path, backends: list[Any]) -> None:
    path = dense_dir if which == "dense" else moe_dir
    batch = _batch()
    mask = batch.loss_mask.bool()
    backends.append(meg32 := _megatron(path, dtype="float32"))
    backends.append(fsdp32 := _fsdp(path, dtype="float32"))
    a, b = meg32.compute_logprobs(batch), fsdp32.compute_logprobs(batch)
    fp32_gap = (a - b).abs()[mask].max().item()
    assert fp32_gap < 1e-4, fp32_gap
    backends.append(meg16 := _megatron(path, dtype="bfloat16"))
    backends.append(fsdp16 := _fsdp(path, dtype="bfloat16"))
    c, d = meg16.compute_logprobs(batch), fsdp16.compute_logprobs(batch)
    floor = (d - b).abs()[mask].mean().item()  # FSDP's own bf16 rounding
    gap = (c - d).abs()[mask].mean().item()
    print(f"{which}: fp32 max gap {fp32_gap:.2e}; bf16 mean gap {gap:.3e}, bf16 floor {floor:.3e}")
    assert gap <= 2 * floor + 1e-6, (gap, floor)


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_one_step_to_the_same_loss_as_fsdp(
    which: str, dense_dir: Path, moe_dir: Path, backends: list[Any]
) -> None:
    path = dense_dir if which == "dense" else moe_dir
    batch = _batch(seed=1)
    backends.append(meg := _megatron(path, dtype="float32"))
    backends.append(fsdp := _fsdp(path, dtype="float32"))
    results = []
    for b in (meg, fsdp):
        old = b.compute_logprobs(batch)
        step = b.train_step(replace(batch, old_logprobs=old), _loss())
        after = b.train_step(replace(batch, old_logprobs=old), _loss())  # the loss the update reached
        results.append((step, after))
    (m1, m2), (f1, f2) = results
    assert m1.loss == pytest.approx(f1.loss, rel=1e-4, abs=1e-6)
    assert m1.grad_norm == pytest.approx(f1.grad_norm, rel=1e-3)
    assert m2.loss == pytest.approx(f2.loss, rel=1e-3, abs=1e-5) and m2.loss != m1.loss
    assert m1.tokens == f1.tokens and set(m1.metrics) >= set(f1.metrics)
    print(f"{which}: loss {m1.loss:.6f} -> {m2.loss:.6f} (fsdp {f1.loss:.6f} -> {f2.loss:.6f})")


def test_r3_forces_the_recorded_experts(moe_dir: Path, backends: list[Any]) -> None:
    batch = _batch(rows=4, moe_layers=2)
    backends.append(meg := _megatron(moe_dir))
    meg.hooks.capture = True
    meg.compute_logprobs(batch)
    used = meg.last_routing.used
    assert sorted(used) == [0, 1]
    n = batch.attention_mask.sum(-1).tolist()
    for i, payload in enumerate(batch.routed_experts):
        assert payload is not None
        want = torch.frombuffer(bytearray(payload), dtype=torch.int32).view(int(n[i]) - 1, 2, 2).long()
        for layer in (0, 1):
            got = used[layer][i, : int(n[i]) - 1]
            assert torch.equal(got.sort(-1).values, want[:, layer].sort(-1).values)  # 100% replayed
    step = meg.train_step(replace(batch, old_logprobs=meg.compute_logprobs(batch)), _loss())
    assert step.metrics["r3_routing_mismatch"] > 0.5  # random experts: mostly not the trainer's own
    assert step.metrics["r3_payload_bytes"] == sum(len(p) for p in batch.routed_experts if p)
    # without replay the routers keep their own choices (and report the same mismatch)
    backends.append(free := _megatron(moe_dir, r3_replay=False))
    free.hooks.capture = True
    free.compute_logprobs(batch)
    own = free.last_routing.used[0][0, : int(n[0]) - 1]
    assert not torch.equal(own, used[0][0, : int(n[0]) - 1])


def _train(backend: Any, batches: list[TrainBatch], offload: bool) -> dict[str, torch.Tensor]:
    for batch in batches:
        old = backend.compute_logprobs(batch)
        backend.train_step(replace(batch, old_logprobs=old), _loss())
        if offload:
            before = torch.cuda.memory_allocated()
            backend.offload()
            assert torch.cuda.memory_allocated() < before
    return {k: v.float().cpu() for k, v in backend.export_weights()}


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_offload_and_streaming_train_to_the_same_weights(
    which: str, dense_dir: Path, moe_dir: Path, backends: list[Any], tmp_path: Path
) -> None:
    path = dense_dir if which == "dense" else moe_dir
    batches = [_batch(seed=s) for s in range(3)]
    backends.append(plain := _megatron(path))
    ref = _train(plain, batches, offload=False)
    variants = {
        "offload-cpu": {"offload": "cpu"},
        "offload-disk": {"offload": "disk", "state_dir": tmp_path / "disk"},
        "streamed": {
            "stream_optimizer_state": True,
            "optimizer_bucket_bytes": 16 << 10,
            "state_dir": tmp_path / "st",
        },
        "streamed+offload-disk": {
            "stream_optimizer_state": True,
            "offload": "disk",
            "state_dir": tmp_path / "both",
        },
    }
    for name, kw in variants.items():
        backends.append(b := _megatron(path, **kw))
        got = _train(b, batches, offload="offload" in name)
        assert set(got) == set(ref)
        assert all(torch.equal(got[k], ref[k]) for k in ref), name
        if "streamed" in name:
            assert b.streamed.peak_resident_bytes > 0
            assert list((tmp_path / kw["state_dir"].name).rglob("*.exp_avg.bin"))


def test_export_round_trip_is_byte_identical(
    dense_dir: Path, moe_dir: Path, backends: list[Any], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    cases = [
        (dense_dir, "float32"),
        (moe_dir, "float32"),
        (_bf16_copy(dense_dir, tmp_path / "bf16"), "bfloat16"),
    ]
    for path, dtype in cases:
        backends.append(b := _megatron(path, dtype=dtype))
        file = load_file(str(path / "model.safetensors"))
        got = dict(b.export_weights())
        assert set(got) == set(file), path
        assert all(torch.equal(got[k].cpu(), file[k]) for k in file), path


def test_checkpoint_resumes_to_the_same_weights(moe_dir: Path, backends: list[Any], tmp_path: Path) -> None:
    batches = [_batch(seed=s, moe_layers=2) for s in range(3)]
    backends.append(a := _megatron(moe_dir, stream_optimizer_state=True, state_dir=tmp_path / "a"))
    _train(a, batches[:1], offload=False)
    a.save(tmp_path / "ckpt", {"note": 1})
    straight = _train(a, batches[1:], offload=False)
    backends.append(b := _megatron(moe_dir, stream_optimizer_state=True, state_dir=tmp_path / "b"))
    assert b.load(tmp_path / "ckpt") == {"note": 1} and b.step == 1
    resumed = _train(b, batches[1:], offload=False)
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def _rl_manifest(tmp_path: Path, checkpoint: Path, steps: int, transport: str, moe: bool) -> Path:
    """examples/tiny-megatron.yaml with another checkpoint, transport and length."""
    doc = yaml.safe_load((Path(__file__).parents[3] / "examples" / "tiny-megatron.yaml").read_text())
    spec = doc["spec"]
    spec["model"]["checkpoint"] = str(checkpoint)
    spec["weightSync"]["transport"] = transport
    spec["schedule"].update(steps=steps, saveInterval=steps, evalInterval=steps)
    if moe:
        spec["algorithm"]["r3"] = True
        spec["algorithm"]["learningRate"] = 3.0e-4
        spec["algorithm"]["sftWarmStart"]["steps"] = 110
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_rl_run_with_the_reference_engine_learns(dense_dir: Path, tmp_path: Path) -> None:
    """`lockstep run` with trainer.backend megatron on CUDA, a bf16 HF checkpoint, disk-delta from Megatron.

    The trainer offloads to host memory after every push (trainer.offload cpu) and the first push goes
    through the pre-flight weight check (engine noise, disk-delta baseline, checksums, logprob probe).
    """
    from lockstep.cli import main
    from lockstep.observability.metrics import read_jsonl

    ckpt = _bf16_copy(dense_dir, tmp_path / "tiny-bf16")
    steps = 200
    t0 = time.monotonic()
    code = main(
        [
            "run",
            str(_rl_manifest(tmp_path, ckpt, steps, "disk-delta", moe=False)),
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    assert code == 0
    train = read_jsonl(tmp_path / "run" / "metrics.jsonl", "train")
    rewards = [r["reward_mean"] for r in train]
    first, last = sum(rewards[:25]) / 25, sum(rewards[-25:]) / 25
    diffs = sorted(r["train_rollout_logprob_abs_diff"] for r in train)
    print(f"RL megatron: {len(train)} steps in {time.monotonic() - t0:.0f} s, reward {first:.3f} -> {last:.3f}, "
          f"median |train-rollout logprob| {diffs[len(diffs) // 2]:.2e}; wire bytes {train[-1].get('update_weights_wire_bytes')}")  # fmt: skip
    assert len(train) == steps
    # 25 steps x 64 samples: the std of a 25-step mean reward is ~0.01, so +0.08 is far beyond noise
    # (FSDP on the CPU, same recipe: 0.21 over steps 1-25, 0.32 over 126-150, 0.43 over 276-300).
    assert last >= first + 0.08, (first, last)
    assert (tmp_path / "run" / "preflight.json").exists()


def test_rl_run_moe_with_r3(moe_dir: Path, tmp_path: Path) -> None:
    from lockstep.cli import main
    from lockstep.observability.metrics import read_jsonl

    code = main(
        [
            "run",
            str(_rl_manifest(tmp_path, moe_dir, 20, "auto", moe=True)),
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    assert code == 0
    train = read_jsonl(tmp_path / "run" / "metrics.jsonl", "train")
    assert len(train) == 20 and all("r3_routing_mismatch" in r for r in train)
    print("RL megatron MoE R3: mismatch", [round(r["r3_routing_mismatch"], 4) for r in train[:5]])
