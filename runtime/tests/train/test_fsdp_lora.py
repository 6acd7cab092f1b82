"""LoRA on the FSDP2 backend (peft), on the built-in tiny model and on the HF-layout Qwen3 fixture.

What must hold: the base weights are bit-identical after training steps; only adapter tensors are
exported (under peft's saved names); a checkpoint is an adapter in peft's layout plus the adapter's
optimizer state, resumes exactly, and loads in peft on the base checkpoint with the trainer's logits.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from lockstep.models import resolve_checkpoint
from lockstep.train.common.batch import TrainBatch
from lockstep.train.common.losses import sft_loss
from lockstep.train.common.packing import pack_sft
from lockstep.train.fsdp import FSDPBackend, FSDPConfig
from lockstep.train.fsdp.lora import AdapterConfig, check_targets
from safetensors.torch import load_file

ADAPTER = AdapterConfig(rank=4, alpha=8, target_modules=("all-linear",), name="job")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(resolve_checkpoint("builtin:tiny", cache_dir=tmp_path_factory.mktemp("cache")))


@pytest.fixture(params=["tiny", "qwen3"])
def model_dir(request: pytest.FixtureRequest, tiny_dir: Path, hf_checkpoint: Callable[[str], Path]) -> Path:
    return tiny_dir if request.param == "tiny" else hf_checkpoint("qwen3")


def _backend(model_dir: Path, **kw: object) -> FSDPBackend:
    cfg = {"model_path": model_dir, "lr": 1e-2, "micro_batch_size": 2, "device": "cpu", "lora": ADAPTER}
    return FSDPBackend(FSDPConfig(**(cfg | kw)))  # type: ignore[arg-type]


@pytest.fixture
def backend(model_dir: Path) -> Iterator[FSDPBackend]:
    b = _backend(model_dir)
    yield b
    b.close()


def _batch() -> TrainBatch:
    return pack_sft(
        [([2, 20, 21, 3], [30, 31, 1]), ([2, 22, 3], [40, 41, 42, 1]), ([2, 23, 24, 25, 3], [50, 1])]
    )


def _base(b: FSDPBackend) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in b.model.state_dict().items()
        if ".lora_" not in k
    }


def test_base_weights_are_bit_identical_after_training_steps(backend: FSDPBackend) -> None:
    before = _base(backend)
    adapter0 = {n: t.clone() for n, t in backend.export_weights()}
    for _ in range(3):
        result = backend.train_step(_batch(), sft_loss)
        assert not result.skipped
    after = _base(backend)
    assert set(before) == set(after) and before
    for k in before:
        assert torch.equal(before[k], after[k]), f"base weight {k} changed"
    adapter3 = dict(backend.export_weights())
    assert any(not torch.equal(adapter0[n], adapter3[n]) for n in adapter0), "the adapter did not train"
    assert backend.step == 3


def test_only_adapter_tensors_are_exported_under_peft_names(backend: FSDPBackend) -> None:
    exported = dict(backend.export_weights())
    assert exported and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in exported)
    assert all(n.startswith("base_model.model.model.layers.") for n in exported)
    a = exported["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = exported["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert a.shape[0] == 4 and b.shape[1] == 4  # [r, in], [out, r]
    assert torch.count_nonzero(b) == 0  # peft starts lora_B at zero: base + adapter == base
    optimized = {id(p) for g in backend.optimizer.param_groups for p in g["params"]}
    names = [n for n, p in backend.model.named_parameters() if id(p) in optimized]
    assert names and all(".lora_" in n for n in names)


def test_export_base_is_the_checkpoint_under_its_own_names_after_training(
    backend: FSDPBackend, model_dir: Path
) -> None:
    # what the adapter pre-flight hashes against each engine's /weights_checker checksums
    for _ in range(2):
        assert not backend.train_step(_batch(), sft_loss).skipped
    base = dict(backend.export_base())
    on_disk: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        on_disk |= load_file(str(f))
    assert set(base) == set(on_disk), set(base) ^ set(on_disk)
    for name, t in on_disk.items():
        assert torch.equal(base[name].to(t.dtype), t), f"export_base {name} is not the checkpoint's"
    assert all(".lora_" not in n and ".base_layer." not in n for n in base)


def test_export_base_refuses_a_model_without_lora(tiny_dir: Path) -> None:
    b = _backend(tiny_dir, lora=None)
    try:
        with pytest.raises(ValueError, match="export_weights"):
            next(iter(b.export_base()))
    finally:
        b.close()


def test_checkpoint_is_a_peft_adapter_that_reproduces_the_trainers_logits(
    backend: FSDPBackend, model_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for _ in range(2):
        backend.train_step(_batch(), sft_loss)
    ckpt = tmp_path / "ckpt"
    backend.save(ckpt, {"marker": 7})
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.pt",
        "rng_rank0.pt",
        "trainer_state.json",
    ]
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert "q_proj" in config["target_modules"]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, ckpt).eval()
    batch = _batch()
    with torch.no_grad():
        logits = peft_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    want = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    got = backend.compute_logprobs(batch)
    mask = batch.loss_mask > 0
    assert torch.allclose(got[mask], want[mask], atol=1e-5)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        base_logits = plain(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert not torch.allclose(base_logits, logits, atol=1e-4)  # the adapter is in the comparison


def test_resume_restores_adapter_and_optimizer_exactly(model_dir: Path, tmp_path: Path) -> None:
    a = _backend(model_dir)
    a.train_step(_batch(), sft_loss)
    a.save(tmp_path / "c", {"k": 1})
    a.train_step(_batch(), sft_loss)
    want = {n: t.clone() for n, t in a.export_weights()}
    a.close()
    b = _backend(model_dir, seed=99)  # another init: everything must come from the checkpoint
    assert b.load(tmp_path / "c") == {"k": 1} and b.step == 1
    b.train_step(_batch(), sft_loss)
    got = dict(b.export_weights())
    b.close()
    assert set(got) == set(want)
    for n in want:
        assert torch.equal(got[n], want[n]), n
    saved = load_file(str(tmp_path / "c" / "adapter_model.safetensors"))
    assert set(saved) == set(want)


def test_load_refuses_an_adapter_of_another_rank(model_dir: Path, tmp_path: Path) -> None:
    a = _backend(model_dir)
    a.save(tmp_path / "c")
    a.close()
    other = AdapterConfig(rank=2, alpha=8, name="job")
    b = _backend(model_dir, lora=other)
    with pytest.raises(ValueError, match=r"another spec\.model\.lora\.rank"):
        b.load(tmp_path / "c")
    b.close()


def test_a_target_the_model_lacks_fails_naming_the_field(tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    check_targets(model, ["q_proj", "down_proj"])
    with pytest.raises(ValueError, match=r"spec.model.lora.targetModules \['qkv_proj'\]: no such linear"):
        check_targets(model, ["q_proj", "qkv_proj"])
    with pytest.raises(ValueError, match="targetModules"):
        _backend(tiny_dir, lora=AdapterConfig(rank=4, alpha=8, target_modules=("wq",), name="j"))
