"""spec.rollout: the rollout engines (one replica's engine settings), their count and scaling, sampling
and the session server.

Why it exists: EngineSpec is what a RolloutPool runs, whether an RLJob's own or a standalone pool,
and `min_available` is the one definition of the engines a pool must have ready; both are shared by
RLJob and RolloutPool, so they live apart from either kind.

Who uses it: lockstep.api.rljob (RLJobSpec.rollout), lockstep.api.rolloutpool, lockstep.api.profiles,
lockstep.config (engines, sampling, sessions), the operator (engine pods, readiness, the roll).
"""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import Field

from lockstep.api.common import EMPTY_DEFAULT, ApiModel, PoolRef

Arg = Annotated[str, Field(max_length=1024)]


class Engine(enum.StrEnum):
    """The rollout engine server."""

    SGLANG = "sglang"
    REFERENCE = "reference"


class Precision(enum.StrEnum):
    """Weight precision (serving or training)."""

    BF16 = "bf16"
    FP8 = "fp8"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"


class KVCacheDtype(enum.StrEnum):
    """KV-cache dtype of the engine, spelled as SGLang's `--kv-cache-dtype` values."""

    AUTO = "auto"
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"


class SessionMode(enum.StrEnum):
    """How the session server stores a multi-turn conversation."""

    LINEAR = "linear"
    BRANCHING = "branching"


class Matcher(enum.StrEnum):
    """How replayed messages are matched to stored token checkpoints."""

    STRICT = "strict"
    LOOSE_TOOL_CALL = "loose_tool_call"
    ROLE_CONTENT_ONLY = "role_content_only"


class Autoscaling(ApiModel):
    """Bounds within which the replica count may move (by `kubectl scale` or an autoscaler)."""

    min_replicas: int = Field(default=1, ge=0, le=4096)
    """Fewest replicas the pool may be scaled to. The job still needs one engine to make progress:
    the gang and the job's readiness count at least one while replicas > 0."""
    max_replicas: int = Field(ge=1, le=4096)
    """Most replicas."""


def min_available(replicas: int, autoscaling: Autoscaling | None) -> int:
    """The engines a pool must have ready, defined once (pure).

    autoscaling.minReplicas (capped at replicas), else replicas; at least one while replicas > 0,
    since a job makes no progress without an engine. The gang's engine members, the job's readiness,
    the pool's MinAvailableBreached and the roll's floor all use it.
    """
    floor = min(autoscaling.min_replicas, replicas) if autoscaling is not None else replicas
    return max(floor, 1 if replicas > 0 else 0)


class SessionSpec(ApiModel):
    """The session server: token-in-token-out multi-turn conversations (§3)."""

    mode: SessionMode = SessionMode.LINEAR
    """`linear` (one path, at most one assistant-turn rollback) or `branching` (a tree, one sample
    per leaf)."""
    matcher: Matcher = Matcher.STRICT
    """`strict` (role, content, reasoning and tool calls), `loose_tool_call` (JSON-equivalent tool
    arguments) or `role_content_only` (risky: ignores tool calls)."""
    max_nodes: int = Field(default=256, ge=1, le=65536)
    """Most checkpoints kept per session (branching mode)."""


class SamplingSpec(ApiModel):
    """Sampling parameters sent with every generate request."""

    max_new_tokens: int = Field(default=1024, ge=1, le=1048576)
    """Most tokens per model reply (one turn)."""
    max_session_tokens: int | None = Field(default=None, ge=1, le=16777216)
    """Most tokens of a whole multi-turn session; unset means no cap beyond the context length. Not
    built yet: refused at apply (rule session-token-cap-not-built)."""
    temperature: float = Field(default=1.0, gt=0.0, le=10.0)
    """Sampling temperature, above 0 (greedy decoding has no logprobs to train on); RL normally keeps
    1.0 so logprobs describe the sampled distribution."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""


class EngineSpec(ApiModel):
    """What one rollout engine replica runs on and how it serves."""

    engine: Engine = Engine.SGLANG
    """`sglang` (production) or `reference` (Lockstep's SGLang-compatible engine on torch, for CPU
    runs and tests)."""
    image: str | None = Field(default=None, max_length=512)
    """Container image of the engine pods; unset uses the operator's default."""
    gpus_per_engine: int = Field(default=1, ge=0, le=64)
    """GPUs of one replica (0 runs the reference engine on CPU)."""
    tensor_parallel: int = Field(default=1, ge=1, le=64)
    """Tensor-parallel size inside a replica; must divide gpusPerEngine."""
    data_parallel_attention: int = Field(default=1, ge=1, le=64)
    """DP-attention size: attention runs data-parallel over this many GPUs of the replica, experts
    stay sharded; 1 is off. Must divide tensorParallel."""
    precision: Precision = Precision.BF16
    """Serving weight precision."""
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    """KV-cache dtype (`auto` follows the weights)."""
    prefill_decode: bool = False
    """Prefill-decode disaggregation (separate prefill and decode servers). Not built yet: true is
    refused at apply (rule prefill-decode-not-built)."""
    multi_token_prediction: bool = False
    """Speculative decoding with the model's MTP draft head (SGLang engines only)."""
    p2p_receiver: bool = Field(default=False, alias="p2pReceiver")
    """The engine image serves Lockstep's P2P receive extension (GET /p2p_receiver_info, POST
    /p2p_receiver_commit; docs/sglang.md). Stock SGLang has none, so for engine `sglang` the operator
    chooses the p2p transport only when this is true; the reference engine always serves it."""
    extra_args: list[Arg] = Field(default_factory=list, max_length=64)
    """Extra engine command-line arguments, appended verbatim."""


class RolloutSpec(EngineSpec):
    """The rollout side: engine replicas, sampling and the session server."""

    replicas: int = Field(default=1, ge=0, le=4096)
    """Engine replicas (one SGLang server each)."""
    autoscaling: Autoscaling | None = None
    """Bounds for scaling the pool; unset pins the pool at replicas."""
    max_in_flight: int = Field(default=64, ge=1, le=1048576)
    """Most trajectories generating at once over the whole pool (set apart from the batch size);
    must be at least samplesPerPrompt, since a whole group is submitted at a time."""
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, json_schema_extra=EMPTY_DEFAULT)
    """Sampling parameters."""
    pool_ref: PoolRef | None = None
    """Sample on an existing standalone RolloutPool (spec.job unset; created by a user, its lifetime
    and scaling its own) instead of a pool of this job: several LoRA jobs share one pool serving one
    base model, each training and sampling its own adapter (docs/lora.md). Needs model.lora (the
    shared base is never written); the pool must serve the same model.checkpoint, with model.lora.rank
    at least this job's. This job's engine fields (replicas, autoscaling, engine, ...) are then unused."""
    session: SessionSpec = Field(default_factory=SessionSpec, json_schema_extra=EMPTY_DEFAULT)
    """Session server settings."""

    @property
    def min_available(self) -> int:
        """The engines the pool must have ready (`min_available` over replicas and autoscaling)."""
        return min_available(self.replicas, self.autoscaling)
