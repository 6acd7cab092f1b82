"""The registry of true-on-policy profiles: which models get the exact-logprob guarantee, and how.

Why it exists: true on-policy (§4.3) is a narrow, strict kernel contract, proved per model: the
rollout engine and the trainer must run one computation, so a model is admitted only once its layers
are all covered by the batch-invariant kernels (lockstep.numerics). Like Miles, Lockstep refuses the
mode at apply for any model without a registered profile rather than run with a weaker promise
(the `true-on-policy-profile` rule in lockstep.api.rules reads `TRUE_ON_POLICY_PROFILES`).

A profile names the model (`family`, and the `variant`s it covers; `None` covers the whole family),
the kernel settings both sides need, and the SGLang server arguments that turn them on in an engine
pod (`sglang_args`; the operator renders them, the reference engine takes the same switches).

Two kernel sets can run a profile's trainer (`trainer_kernels_for`): `lockstep` (the exact kernels of
lockstep.numerics, which the reference engine runs too) when the rollout engine is the reference
engine, and `sglang` (lockstep.numerics.sglang_kernels: the trainer computes as stock SGLang's
`--rl-on-policy-target fsdp` path does) when the rollout engine is SGLang; only profiles with
`sglang_kernels` admit `engine: sglang` (rule `true-on-policy-sglang-kernels`).

`sglang_args_for(spec)` is the one place that turns a job's numerics (true on-policy, serving
precision, KV-cache dtype) into SGLang server arguments.

Who calls it: lockstep.api.rules (apply-time refusal), the runtime (`profile_for`), the operator's
engine rendering (`sglang_args_for`), docs/true-on-policy.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from lockstep.api.rljob import Engine, KVCacheDtype, Precision, RLJobSpec

SGLANG_VERSION: Final = "0.5.23"
"""The SGLang release the engine flags, the HTTP contract and the trainer's `sglang` kernels are
checked against (the engine image's SGLang, and the trainer image's for kernels `sglang`, must match;
scripts/setup.sh installs the same for the contract tests)."""

SGLANG_TRUE_ON_POLICY_ENV: Final[dict[str, str]] = {"SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_DEEPGEMM": "0"}
"""Environment of true-on-policy SGLang engines and of a trainer on kernels `sglang`: SGLang's
batch-invariant matmul on its Triton persistent kernel on both sides (DeepGEMM is taken only where
deep_gemm imports, so two images could otherwise run different GEMMs)."""

SGLANG_TRUE_ON_POLICY_ARGS: Final[tuple[str, ...]] = (
    "--enable-deterministic-inference",
    "--rl-on-policy-target",
    "fsdp",
    "--attention-backend",
    "fa3",
)
"""SGLang's switches for true on-policy against an FSDP trainer (batch-invariant kernels,
deterministic sampling, the trainer's numerics for norms/rope/activations, FlashAttention-3)."""


@dataclass(frozen=True, slots=True)
class Profile:
    """One registered true-on-policy profile."""

    name: str
    """Stable id (docs, logs)."""
    family: str
    """spec.model.family it covers."""
    variants: tuple[str, ...] | None
    """spec.model.variant values it covers; None covers every variant (and none)."""
    attention: str
    """The attention both sides run with the `lockstep` kernels: `lockstep_exact`
    (lockstep.numerics.kernels.attention). With the `sglang` kernels it is FlashAttention-3."""
    matmul: str
    """The matmul both sides run with the `lockstep` kernels: fixed tiles, fp32 accumulation, inner
    tiles added in order. With the `sglang` kernels it is SGLang's Triton persistent matmul."""
    sglang_args: tuple[str, ...] = SGLANG_TRUE_ON_POLICY_ARGS
    """Arguments appended to `python -m sglang.launch_server` for this profile."""
    dense_only: bool = True
    """MoE checkpoints of the family are refused at start (no batch-invariant expert dispatch)."""
    sglang_kernels: bool = False
    """Whether the trainer can compute as stock SGLang's on-policy path does for these models
    (lockstep.numerics.sglang_kernels, Qwen3 dense), so `rollout.engine: sglang` is admitted."""

    def covers(self, family: str, variant: str | None) -> bool:
        return family == self.family and (self.variants is None or variant in self.variants)


EXACT_ATTENTION: Final = "lockstep_exact"
ORDERED_MATMUL: Final = "tiled-fp32-ordered"

PROFILES: Final[tuple[Profile, ...]] = (
    Profile("tiny", "tiny", None, EXACT_ATTENTION, ORDERED_MATMUL),
    Profile(
        "qwen3-dense-small",
        "qwen3",
        ("0.6b", "1.7b", "4b"),
        EXACT_ATTENTION,
        ORDERED_MATMUL,
        sglang_kernels=True,
    ),
)
"""Registered profiles: the tiny family (CPU runs and tests, reference engine only) and dense Qwen3
0.6B / 1.7B / 4B (either engine)."""

TRUE_ON_POLICY_FAMILIES: Final[tuple[str, ...]] = tuple(p.family for p in PROFILES if p.variants is None)
"""Families registered whole (any variant)."""

TRUE_ON_POLICY_PROFILES: Final[tuple[str, ...]] = tuple(
    f"{p.family}-{v}" for p in PROFILES for v in (p.variants or ())
)
"""`family-variant` pairs registered one by one."""


SGLANG_KERNEL_PROFILES: Final[tuple[str, ...]] = tuple(
    f"{p.family}-{v}" for p in PROFILES if p.sglang_kernels for v in (p.variants or ())
)
"""`family-variant` pairs whose trainer can compute as stock SGLang does (engine: sglang admitted)."""

LOCKSTEP_KERNELS: Final = "lockstep"
SGLANG_KERNELS: Final = "sglang"


def trainer_kernels_for(spec: RLJobSpec, *, embedded_engines: bool = False) -> str | None:
    """The trainer's kernel set for a job: None without true on-policy; `sglang` against stock SGLang
    engines (lockstep.numerics.sglang_kernels); `lockstep` against the reference engine
    (lockstep.numerics.exact, which the engine runs too), also whenever the engines are the reference
    engines `lockstep run` embeds (`embedded_engines`), whatever spec.rollout.engine says."""
    if not spec.algorithm.true_on_policy:
        return None
    if embedded_engines or spec.rollout.engine is not Engine.SGLANG:
        return LOCKSTEP_KERNELS
    return SGLANG_KERNELS


def profile_for(family: str, variant: str | None) -> Profile | None:
    """The profile covering this model, or None (true on-policy is then refused)."""
    return next((p for p in PROFILES if p.covers(family, variant)), None)


def registered_names() -> str:
    """The registered models, for messages: `tiny (any variant), qwen3-0.6b, ...`."""
    return ", ".join([f"{f} (any variant)" for f in TRUE_ON_POLICY_FAMILIES] + list(TRUE_ON_POLICY_PROFILES))


SGLANG_QUANTIZATION: Final[dict[Precision, str]] = {
    Precision.FP8: "fp8",
    Precision.MXFP8: "mxfp8",
    Precision.NVFP4: "modelopt_fp4",
}
"""spec.rollout.precision -> SGLang's --quantization (the checkpoint's quantization_config says the
block size and the ignored layers; docs/precision.md)."""


def sglang_args_for(spec: RLJobSpec) -> list[str]:
    """The SGLang server arguments a job's numerics need: the profile's true-on-policy switches,
    --quantization for low-precision serving, --kv-cache-dtype unless auto."""
    args: list[str] = []
    if spec.algorithm.true_on_policy:
        profile = profile_for(spec.model.family, spec.model.variant)
        if profile is None:
            raise ValueError(
                f"spec.algorithm.trueOnPolicy: no profile for {spec.model.family} {spec.model.variant or ''}; "
                f"registered: {registered_names()}"
            )
        args += profile.sglang_args
    if spec.rollout.precision is not Precision.BF16:
        args += ["--quantization", SGLANG_QUANTIZATION[spec.rollout.precision]]
    if spec.rollout.kv_cache_dtype is not KVCacheDtype.AUTO:
        args += ["--kv-cache-dtype", spec.rollout.kv_cache_dtype.value]
    return args
