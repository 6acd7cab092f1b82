"""Trainer kernels `sglang` on the CPU: the installs, the refusals, and the kernel set a job gets.

- The module installs of lockstep.numerics.sglang_kernels turn the trainer's HF Qwen3 forward into a
  forward written from SGLang's Qwen3 definition (sglang_reference.py, with SGLang's own rotary
  function from the pinned wheel): the same logprob bits on a tiny Qwen3 (the GPU file does the same
  with SGLang's batch-invariant ops enabled, at the Qwen3-0.6B shape). Without the installs they differ.
- `apply` refuses, naming the fix: a model that is not Qwen3 dense, parameters not in bf16, a CPU
  device; `check_ops` refuses SGLang's ops imported with DeepGEMM on.
- `trainer_kernels_for`: `sglang` against SGLang engines, `lockstep` against the reference engine.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import sglang_source
import torch
from lockstep.api import RLJobSpec
from lockstep.api.profiles import trainer_kernels_for
from lockstep.models.tiny import tiny_config, tiny_moe_config
from lockstep.numerics import exact, sglang_kernels
from lockstep.train.fsdp import FSDPConfig
from sglang_reference import qwen3_model, score, sglang_forward_logprobs

LENGTHS = (5, 11, 3, 8, 40, 64)  # long enough that a q/k-norm rounding change shows


def _seqs(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(6, vocab, (n,), generator=gen) for n in LENGTHS]


def test_installed_forward_equals_sglangs_definition() -> None:
    model = qwen3_model(tiny_config(), "cpu")
    seqs = _seqs(model.config.vocab_size)
    rope = sglang_source.apply_rotary_emb()
    sglang_kernels.install(model, "cpu", exact.ATTN_IMPLEMENTATION)
    with torch.no_grad():
        theirs = sglang_forward_logprobs(model, seqs, rope)
    ours = score(model, seqs)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_without_the_installs_the_forward_is_not_sglangs() -> None:
    model = qwen3_model(tiny_config(), "cpu")
    seqs = _seqs(model.config.vocab_size)
    with torch.no_grad():
        theirs = sglang_forward_logprobs(model, seqs, sglang_source.apply_rotary_emb())
    exact.install_attention(model, "cpu")
    model.set_attn_implementation(exact.ATTN_IMPLEMENTATION)  # same attention, HF's own bf16 math
    ours = score(model, seqs)
    assert not all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("moe", "reproduce SGLang's Qwen3 dense path only"),
        ("float32", "compute from the bf16 weights the engine receives"),
        ("cpu", "run on CUDA only"),
    ],
)
def test_apply_refuses_naming_the_fix(case: str, message: str) -> None:
    from transformers import AutoModelForCausalLM

    if case == "moe":
        model: Any = AutoModelForCausalLM.from_config(tiny_moe_config()).to(torch.bfloat16)
    else:
        model = qwen3_model(tiny_config(), "cpu")
        if case == "float32":
            model = model.float()
    with pytest.raises(ValueError, match=message):
        sglang_kernels.apply(model, "cpu")


def test_check_ops_refuses_deepgemm() -> None:
    assert sglang_kernels.check_ops(sglang_source.batch_invariant_ops())._ENABLE_MM_DEEPGEMM is False
    with pytest.raises(RuntimeError, match="SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_DEEPGEMM=0"):
        sglang_kernels.check_ops(types.SimpleNamespace(_ENABLE_MM_DEEPGEMM=True))


@pytest.mark.parametrize(
    ("true_on_policy", "engine", "embedded", "kernels"),
    [
        (False, "sglang", False, None),
        (False, "reference", False, None),
        (True, "sglang", False, "sglang"),
        (True, "reference", False, "lockstep"),
        (True, "sglang", True, "lockstep"),  # `lockstep run` embeds reference engines
    ],
)
def test_trainer_kernels_follow_the_rollout_engine(
    true_on_policy: bool, engine: str, embedded: bool, kernels: str | None
) -> None:
    spec = RLJobSpec.model_validate(
        {
            "model": {"checkpoint": "Qwen/Qwen3-4B", "family": "qwen3", "variant": "4b"},
            "algorithm": {"trueOnPolicy": true_on_policy},
            "rollout": {"engine": engine},
            "trainer": {"backend": "fsdp"},
            "data": {"prompts": "builtin:reverse"},
        }
    )
    assert trainer_kernels_for(spec, embedded_engines=embedded) == kernels


def test_fsdp_config_names_the_kernel_sets() -> None:
    with pytest.raises(ValueError, match="use lockstep or sglang"):
        FSDPConfig(model_path="unused", kernels="cublas")
