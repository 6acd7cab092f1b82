"""The SGLang server command of an engine pod: every flag the spec asks for, in SGLang's spelling.

Why it exists: stock SGLang is the production engine, and a flag it does not know stops the pod at
start-up. The flags are written here once, for the pinned SGLang (scripts/setup.sh installs it for
the tests only), and runtime/tests/sglang/test_engine_flags.py parses every rendering with SGLang's
own ServerArgs parser and checks the parsed values against the spec. Called by resources.commands.

Spec -> flags: tensorParallel -> --tp-size; dataParallelAttention > 1 -> --attn-dp-size (SGLang's
spelling since `--enable-dp-attention --dp-size` was deprecated); precision fp8 | mxfp8 | nvfp4 ->
--quantization fp8 | mxfp8 | modelopt_fp4 (lockstep.api.profiles.SGLANG_QUANTIZATION: the format of
the converted checkpoint the model path then names, resources.model; SGLang loads it as it is and
every update arrives quantized by the same recipe); kvCacheDtype -> --kv-cache-dtype; R3 -> --enable-return-routed-experts; true-on-policy ->
the model's profile's switches (lockstep.api.profiles: --enable-deterministic-inference
--rl-on-policy-target fsdp --attention-backend fa3, plus TRUE_ON_POLICY_ENV); a
prefill-decode role -> --disaggregation-mode; multiTokenPrediction -> EAGLE speculative decoding over
the model's MTP head; model.lora -> --enable-lora --max-lora-rank --lora-target-modules;
--weight-version 0 (the loaded checkpoint is version 0, as the reference engine reports). The key: never
a flag. The container runs SGLANG_START first (lockstep.observability.sglang_start), which writes the
job's key from the Secret-backed env var into the `--config` file SGLang reads and a logging
configuration that redacts it, then execs SGLang, so neither the command line nor SGLang's start-up log
(which prints every resolved argument) shows it.
"""

from __future__ import annotations

from typing import Literal

from lockstep.api.profiles import (
    SGLANG_QUANTIZATION,
    SGLANG_TRUE_ON_POLICY_ARGS,
    SGLANG_TRUE_ON_POLICY_ENV,
    profile_for,
)
from lockstep.api.profiles import SGLANG_VERSION as SGLANG_VERSION  # the pin (the trainer reads it too)
from lockstep.api.rljob import EngineSpec, KVCacheDtype, ModelSpec

from lockstep_operator.resources.common import ENGINE_PORT, POD_IP_ENV

MTP_FLAGS = (
    "--speculative-algorithm", "EAGLE",
    "--speculative-num-steps", "3",
    "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "4",
)  # fmt: skip
"""Speculative decoding with the model's own MTP layers as the draft (SGLang's DeepSeek/GLM recipe)."""

TRUE_ON_POLICY_ENV = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", **SGLANG_TRUE_ON_POLICY_ENV}
"""Environment of true-on-policy engines: a fixed NCCL reduction order, deterministic cuBLAS, and
SGLang's batch-invariant matmul on the Triton kernel the trainer runs too."""

SGLANG_START = ("python3", "-m", "lockstep.observability.sglang_start", "--")
"""The engine container's command before SGLang's: the key through --config, redacted logs."""

Disaggregation = Literal["prefill", "decode"]
"""The role of one server of a prefill-decode pair."""


def sglang_command(
    engine: EngineSpec,
    model: ModelSpec,
    *,
    r3: bool = False,
    true_on_policy: bool = False,
    disaggregation: Disaggregation | None = None,
) -> list[str]:
    """`python3 -m sglang.launch_server ...` for one engine replica (pure); the pod runs it behind
    SGLANG_START, which adds `--config` with the key."""
    cmd = [
        "python3", "-m", "sglang.launch_server",
        "--model-path", model.checkpoint,
        "--host", f"$({POD_IP_ENV})",  # the pod IP, never all interfaces
        "--port", str(ENGINE_PORT),
        "--tp-size", str(engine.tensor_parallel),
        "--weight-version", "0",
        "--enable-metrics",  # sglang:* series at GET /metrics of the HTTP port (manifests/monitoring scrape them)
    ]  # fmt: skip
    if model.tokenizer:
        cmd += ["--tokenizer-path", model.tokenizer]
    if engine.data_parallel_attention > 1:
        cmd += ["--attn-dp-size", str(engine.data_parallel_attention)]
    if engine.precision in SGLANG_QUANTIZATION:  # the converted checkpoint's own format
        cmd += ["--quantization", SGLANG_QUANTIZATION[engine.precision]]
    if engine.kv_cache_dtype is not KVCacheDtype.AUTO:
        cmd += ["--kv-cache-dtype", engine.kv_cache_dtype.value]
    if r3:
        cmd += ["--enable-return-routed-experts"]
    if true_on_policy:  # the model's registered profile (the API refuses true on-policy without one)
        profile = profile_for(model.family, model.variant)
        cmd += list(profile.sglang_args if profile is not None else SGLANG_TRUE_ON_POLICY_ARGS[:3])
    if disaggregation is not None:
        cmd += ["--disaggregation-mode", disaggregation]
    if engine.multi_token_prediction:
        cmd += list(MTP_FLAGS)
    return cmd + lora_flags(model) + list(engine.extra_args)


def lora_flags(model: ModelSpec) -> list[str]:
    """SGLang's LoRA serving flags for a model with spec.model.lora (pure): adapters are loaded at run
    time, so the rank and targets are declared up front (--max-lora-rank, --lora-target-modules;
    `all` for all-linear, SGLang's spelling). Empty without LoRA."""
    if model.lora is None:
        return []
    targets = ["all"] if "all-linear" in model.lora.target_modules else list(model.lora.target_modules)
    # SGLang's `all` covers every linear layer and the embedding/output heads, so names beside it add nothing
    return ["--enable-lora", "--max-lora-rank", str(model.lora.rank), "--lora-target-modules", *targets]
