"""RLJob: the user's whole interface to one RL post-training run.

Why it exists: a job is a model, an algorithm, a rollout pool, a trainer, a way to sync weights, a
schedule, data, an agent and a placement. This module declares all of it once, with the defaults of
the Miles v0.1 design (seed) and a documented meaning per field; lockstep.api.crdgen turns it into the
CRD (so `kubectl explain rljob.spec.rollout` reads these docstrings) and lockstep.api.rules adds the
cross-field checks. The sections (ModelSpec, RolloutSpec, TrainerSpec, WeightSyncSpec, ...) are reused
by the child kinds RolloutPool, TrainerGroup and WeightChannel.

Who uses it: `lockstep run` and `lockstep validate` (through load_manifest), the driver and the
trainer (they read the typed spec), the operator (it reconciles RLJobs into children and writes the
status).
"""

from __future__ import annotations

import datetime as dt
import enum
import re
from typing import Annotated, Final, Literal

from pydantic import Field, model_validator

from lockstep.api.common import (
    EMPTY_DEFAULT,
    IMPORT_PATH_PATTERN,
    NAME_PATTERN,
    ApiModel,
    Condition,
    KubeObject,
)

# Bounded strings inside lists and maps: the apiserver estimates CEL cost from these bounds.
Label = Annotated[str, Field(max_length=63)]
Arg = Annotated[str, Field(max_length=1024)]
ModulePattern = Annotated[str, Field(min_length=1, max_length=256)]

# ---------------------------------------------------------------------------------------------- model


class LoraSpec(ApiModel):
    """Low-rank adapters trained instead of the full weights."""

    rank: int = Field(ge=1, le=1024)
    """Adapter rank r."""
    alpha: int = Field(default=16, ge=1, le=4096)
    """Scaling numerator; the adapter output is scaled by alpha / rank."""
    target_modules: list[Label] = Field(default_factory=lambda: ["all-linear"], max_length=64)
    """Module names (or `all-linear`) that get adapters."""


HUB_ID_PATTERN: Final = (
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}(@[A-Za-z0-9._/-]{1,255})?$"
)
"""A Hugging Face repo id with an optional revision: `org/name` or `org/name@rev` (branch, tag or commit),
the shape the runtime's checkpoint resolver accepts. A local directory in a cluster is an absolute
path, so it never reads as a repo id."""


def is_hub_id(ref: str) -> bool:
    """Whether a checkpoint or tokenizer reference names a hub repo (`org/name[@rev]`), not a local
    directory or `builtin:<name>` (pure)."""
    return re.fullmatch(HUB_ID_PATTERN, ref) is not None and ".." not in ref.split("@", 1)[0]


class SecretKeySelector(ApiModel):
    """One key of a Secret in the job's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    """Secret name."""
    key: str = Field(default="token", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    """Key within the Secret."""


class ModelSpec(ApiModel):
    """The policy model. Immutable after creation: a new model is a new job."""

    checkpoint: str = Field(min_length=1, max_length=1024)
    """Where the initial weights are: a Hugging Face repo id (`Qwen/Qwen3-4B`), a directory holding an
    HF checkpoint (`/models/qwen3-4b`), or `builtin:<name>` for a model that ships with Lockstep and
    needs no download (`builtin:tiny`, a tiny Qwen3-architecture model for CPU runs and tests)."""
    family: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]*$")
    """Model family, lowercase (`qwen3`, `glm5`, ...): picks the chat-template boundary rules of the
    session server and the true-on-policy profile."""
    variant: str | None = Field(default=None, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]*$")
    """Size or variant tag within the family (`0.6b`, `4b`, `744b-a40b`); true-on-policy needs a
    registered family-variant profile."""
    tokenizer: str | None = Field(default=None, max_length=1024)
    """Tokenizer location when it differs from the checkpoint (same forms as checkpoint)."""
    chat_template: str | None = Field(default=None, max_length=1024)
    """Path of a Jinja chat template overriding the tokenizer's own."""
    hub_token_secret: SecretKeySelector | None = None
    """Secret holding a Hugging Face token for a gated or private hub checkpoint (`name`, and `key`,
    default `token`). In a cluster only the init step that downloads the model gets it, as HF_TOKEN
    from the Secret; it is never in job.yaml or the logs."""
    lora: LoraSpec | None = None
    """Train LoRA adapters instead of the full weights; unset trains all weights. Not built yet:
    refused at apply (rule lora-not-built)."""
    bf16_modules: list[ModulePattern] = Field(default_factory=list, max_length=256)
    """BF16 exceptions of a low-precision recipe (rollout or trainer precision other than bf16):
    module-name patterns (fnmatch over HF names without `.weight`, e.g. `model.layers.27.*`,
    `*.shared_expert.*`) kept in BF16 at all four stages (conversion, training forward, export,
    rollout). Linear weights whose contraction axis does not fill whole blocks stay BF16 anyway."""


# ------------------------------------------------------------------------------------------ algorithm


class AdvantageEstimator(enum.StrEnum):
    """How advantages are computed from rewards."""

    GRPO = "grpo"
    PPO = "ppo"
    GSPO = "gspo"


class MismatchCorrection(enum.StrEnum):
    """Per-token correction of the train-rollout mismatch m_t = exp(train_logp - rollout_logp)."""

    TIS = "tis"
    CLIP_OR_POP = "clip-or-pop"
    OFF = "off"


class KLEstimator(enum.StrEnum):
    """Estimator of KL(policy || reference) per token (Schulman's k1, k2, k3)."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class MismatchSpec(ApiModel):
    """Train-rollout mismatch correction (seed §4.2)."""

    correction: MismatchCorrection = MismatchCorrection.OFF
    """`tis` multiplies each token's loss by clamp(m_t, low, high); `clip-or-pop` keeps m_t inside
    [low, high] and gives tokens outside weight 0; `off` applies nothing (metrics are still logged)."""
    low: float = Field(default=0.0, ge=0.0, le=1000.0)
    """Lower bound l of the ratio interval [l, u]; must be below high."""
    high: float = Field(default=2.0, gt=0.0, le=1000.0)
    """Upper bound u of the ratio interval [l, u]."""


class KLSpec(ApiModel):
    """KL penalty against the reference policy: the policy RL starts from (the warm-started one after an
    SFT warm start, else the checkpoint as loaded)."""

    coef: float = Field(default=0.0, ge=0.0, le=100.0)
    """Coefficient of the KL loss; 0 disables it (and the reference model is not loaded)."""
    estimator: KLEstimator = KLEstimator.K3
    """Per-token KL estimator."""


class Teacher(ApiModel):
    """One on-policy-distillation teacher, served by its own SGLang server."""

    name: str = Field(min_length=1, max_length=63, pattern=NAME_PATTERN)
    """Teacher name, unique in the list; samples are routed to it by label."""
    url: str = Field(min_length=1, max_length=512, pattern=r"^https?://")
    """Base URL of the teacher's SGLang server (`http://host:port`)."""
    labels: list[Label] = Field(default_factory=list, max_length=64)
    """Sample labels routed to this teacher."""


class OPDSpec(ApiModel):
    """On-policy distillation: teachers score the student's sampled tokens (seed §8.1)."""

    teachers: list[Teacher] = Field(
        min_length=1,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """The teachers, keyed by name (names unique)."""
    default_teacher: str | None = Field(default=None, max_length=63)
    """Teacher for samples whose label no teacher lists; unset makes such a sample an error."""
    coef: float = Field(default=1.0, ge=0.0, le=100.0)
    """Weight of the reverse-KL term: advantage -= coef * (student_logp - teacher_logp)."""

    @model_validator(mode="after")
    def _unique_teacher_names(self) -> OPDSpec:
        # the CRD declares teachers a map keyed by name; the apiserver refuses duplicates the same way
        names = [t.name for t in self.teachers]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"teacher names must be unique; repeated: {', '.join(repeated)}")
        return self


class SFTWarmStartSpec(ApiModel):
    """Supervised steps on the task's reference answers before RL starts (off with steps 0)."""

    steps: int = Field(default=0, ge=0, le=100000000)
    """SFT optimizer steps before the first RL step (with stopAtLoss: the most it may take); 0 skips
    the warm start."""
    learning_rate: float | None = Field(default=None, gt=0.0, le=1.0)
    """Learning rate of the SFT steps; unset uses algorithm.learningRate."""
    stop_at_loss: float | None = Field(default=None, gt=0.0, le=100.0)
    """End the warm start once the mean SFT loss (per answer token) of its last 5 steps is at or
    below this. A fixed step count stops each seed at a different point of a steep loss curve (issue
    18 measured 0.50 to 1.02 after 85 steps); a loss target stops every seed at the same point, so RL
    starts from comparable policies. Unset runs all `steps`."""


class LRDecay(enum.StrEnum):
    """How the RL learning rate moves from learningRate (after warmup) to minLearningRate."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


class LRScheduleSpec(ApiModel):
    """The RL learning rate over the run's steps (spec.schedule.steps): a linear warmup from 0 to
    learningRate, then a decay to minLearningRate at the last step. The SFT warm start keeps its own
    constant rate. The default (no warmup, constant) is a constant learningRate."""

    warmup_steps: int = Field(default=0, ge=0, le=100000000)
    """RL steps of linear warmup (step k of n trains at learningRate x k / n); must be fewer than
    schedule.steps."""
    decay: LRDecay = LRDecay.CONSTANT
    """`constant`, `linear` or `cosine` from learningRate right after warmup towards minLearningRate,
    reached one step after the last (every step trains at a rate above it). A decay lets the policy
    settle late in the run, where a constant rate keeps perturbing a nearly solved policy."""
    min_learning_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    """Where a decay ends; at most learningRate."""


class DynamicSamplingSpec(ApiModel):
    """DAPO's dynamic sampling (sync schedule): a group whose samples all got the same reward has
    advantage 0 on every token and trains nothing, so it is dropped and more prompts are generated
    until the step holds batchSize groups with a reward spread. Costs rollouts, not optimizer steps;
    each step's groups_generated and groups_dropped are logged."""

    max_groups_per_step: int = Field(ge=1, le=1048576)
    """Most groups generated for one step, dropped ones included: at least algorithm.batchSize. When
    it is reached the step trains on the groups with a spread it has (on the first batchSize
    generated when none has one), so a step never waits forever on prompts the policy always or
    never solves."""


class AlgorithmSpec(ApiModel):
    """The RL objective and its corrections."""

    advantage_estimator: AdvantageEstimator = AdvantageEstimator.GRPO
    """`grpo` (group-normalised rewards), `ppo` or `gspo` (sequence-level ratios)."""
    samples_per_prompt: int = Field(default=8, ge=1, le=1024)
    """Samples per prompt: the size of a group."""
    batch_size: int = Field(default=8, ge=1, le=65536)
    """Groups (prompts) per optimizer step; a step trains on batchSize x samplesPerPrompt samples."""
    learning_rate: float = Field(default=1e-6, gt=0.0, le=1.0)
    """Optimizer learning rate."""
    eps_clip: float = Field(default=0.2, gt=0.0, le=10.0)
    """PPO ratio clip epsilon (lower, and upper unless epsClipHigh is set)."""
    eps_clip_high: float | None = Field(default=None, gt=0.0, le=10.0)
    """Upper PPO clip epsilon for asymmetric clipping; unset uses epsClip."""
    kl: KLSpec = Field(default_factory=KLSpec, json_schema_extra=EMPTY_DEFAULT)
    """KL penalty."""
    mismatch: MismatchSpec = Field(default_factory=MismatchSpec, json_schema_extra=EMPTY_DEFAULT)
    """Train-rollout mismatch correction, default off with bounds [0, 2]."""
    r3: bool = False
    """Rollout routing replay: the engine records the experts chosen per token per MoE layer and the
    trainer replays them (MoE models only)."""
    true_on_policy: bool = False
    """Deterministic, batch-invariant kernels on both sides so train and rollout logprobs are equal.
    Needs a registered model profile and the fsdp backend."""
    opd: OPDSpec | None = None
    """On-policy distillation; unset disables it. Not built yet: refused at apply (rule opd-not-built)."""
    sft_warm_start: SFTWarmStartSpec = Field(
        default_factory=SFTWarmStartSpec, json_schema_extra=EMPTY_DEFAULT
    )
    """SFT warm start on the task's reference answers before RL (off by default)."""
    lr_schedule: LRScheduleSpec = Field(default_factory=LRScheduleSpec, json_schema_extra=EMPTY_DEFAULT)
    """The RL learning rate over the steps: warmup and decay (default constant)."""
    dynamic_sampling: DynamicSamplingSpec | None = None
    """Drop groups without a reward spread and generate more (sync schedule); unset trains every
    group generated."""


# -------------------------------------------------------------------------------------------- rollout


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
    """The session server: token-in-token-out multi-turn conversations (seed §3)."""

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
    session: SessionSpec = Field(default_factory=SessionSpec, json_schema_extra=EMPTY_DEFAULT)
    """Session server settings."""

    @property
    def min_available(self) -> int:
        """The engines the pool must have ready (`min_available` over replicas and autoscaling)."""
        return min_available(self.replicas, self.autoscaling)


# -------------------------------------------------------------------------------------------- trainer


class TrainerBackend(enum.StrEnum):
    """The training backend. Immutable after creation."""

    MEGATRON = "megatron"
    FSDP = "fsdp"


class Device(enum.StrEnum):
    """Where trainer ranks run."""

    CUDA = "cuda"
    CPU = "cpu"


class Offload(enum.StrEnum):
    """Where the trainer's state goes between steps (seed §7.1)."""

    NONE = "none"
    CPU = "cpu"
    DISK = "disk"


class Parallelism(ApiModel):
    """Trainer parallelism. TP x PP x CP must divide the GPU count; the rest is data parallel.
    EP does not multiply the GPU count: experts are spread over the same ranks (EP x ETP must divide
    GPUs / PP)."""

    tensor: int = Field(default=1, ge=1, le=1024)
    """Tensor parallel size (TP)."""
    pipeline: int = Field(default=1, ge=1, le=1024)
    """Pipeline parallel size (PP)."""
    context: int = Field(default=1, ge=1, le=1024)
    """Context parallel size (CP). Not built yet: only 1 is accepted (rule context-parallel-not-built)."""
    expert: int = Field(default=1, ge=1, le=1024)
    """Expert parallel size (EP) of MoE layers."""
    expert_tensor: int = Field(default=1, ge=1, le=1024)
    """Expert tensor parallel size (ETP) of MoE layers."""


class TrainerSpec(ApiModel):
    """The trainer: backend, size, parallelism, precision and memory."""

    backend: TrainerBackend = TrainerBackend.MEGATRON
    """`megatron` or `fsdp` (FSDP2). Immutable after creation."""
    image: str | None = Field(default=None, max_length=512)
    """Container image of the trainer pods; unset uses the operator's default."""
    device: Device = Device.CUDA
    """`cuda`, or `cpu` for local runs and tests (gloo)."""
    nodes: int = Field(default=1, ge=1, le=4096)
    """Trainer nodes."""
    gpus_per_node: int = Field(default=8, ge=1, le=64)
    """GPUs per trainer node, one rank each (with device cpu: ranks per node)."""
    parallelism: Parallelism = Field(default_factory=Parallelism, json_schema_extra=EMPTY_DEFAULT)
    """TP, PP, CP, EP, ETP."""
    precision: Precision = Precision.BF16
    """Training weight precision."""
    offload: Offload = Offload.NONE
    """Move weights, gradients and optimizer state off the GPU between steps: `cpu` memory or local
    `disk` (megatron only)."""
    stream_optimizer_state_to_disk: bool = False
    """Keep optimizer state on local disk and stream it in bucket by bucket at the optimizer step
    (to fit, not to go faster)."""
    grad_clip: float = Field(default=1.0, gt=0.0, le=1000000.0)
    """Clip the global gradient norm to this before each optimizer step."""
    micro_batch_size: int = Field(default=64, ge=1, le=1048576)
    """Rows (samples) per forward/backward pass; gradients accumulate over a step's micro-batches."""


# ---------------------------------------------------------------------------------------- weight sync


class Transport(enum.StrEnum):
    """How a weight version travels from the trainer to the engines."""

    AUTO = "auto"
    BROADCAST = "broadcast"
    P2P = "p2p"
    DISK_DELTA = "disk-delta"
    CUDA_IPC = "cuda-ipc"


class DeltaEncoding(enum.StrEnum):
    """Disk-delta encoding."""

    XOR = "xor"
    OVERWRITE = "overwrite"


class Checksum(enum.StrEnum):
    """Checksum of patched tensors."""

    XXH3_128 = "xxh3-128"
    BLAKE3 = "blake3"
    ADLER32 = "adler32"


class PauseMode(enum.StrEnum):
    """What happens to in-flight requests while weights are installed (SGLang pause_generation)."""

    RETRACT = "retract"
    ABORT = "abort"
    IN_PLACE = "in_place"


class DiskDeltaSpec(ApiModel):
    """Disk-delta transport: publish compressed byte deltas to shared storage (seed §7.2.4)."""

    encoding: DeltaEncoding = DeltaEncoding.XOR
    """`xor` (smaller; apply exactly once) or `overwrite` (positions and values; idempotent)."""
    zstd_level: int = Field(default=1, ge=1, le=22)
    """Zstandard compression level."""
    checksum: Checksum = Checksum.XXH3_128
    """Checksum of each patched tensor."""
    volume_claim: str | None = Field(default=None, max_length=253)
    """PersistentVolumeClaim (ReadWriteMany) that holds the published versions in the cluster."""
    path: str = Field(default="/var/lib/lockstep/deltas", min_length=1, max_length=1024)
    """Directory of the published versions (mount path of volumeClaim, or a local directory)."""


class WeightSyncSpec(ApiModel):
    """How trainer weights reach the engines after each update."""

    transport: Transport = Transport.AUTO
    """`auto` lets the operator choose from the topology (the choice and why appear in
    status.transport and status.transportReason)."""
    bucket_mib: int = Field(default=512, ge=1, le=65536, alias="bucketMiB")
    """Bucket size in MiB of the gather-convert-send pipeline."""
    check_weight_update_equal: bool = False
    """Preflight: fill engine tensors with noise, sync, and compare every tensor with the trainer's
    copy before the first step (also probes logprobs)."""
    update_interval: int = Field(default=1, ge=1, le=1000000)
    """Publish a new version every this many steps (version == step only with 1)."""
    pause_mode: PauseMode = PauseMode.RETRACT
    """What in-flight requests do during an update: `retract` (resume on new weights), `abort`, or
    `in_place`."""
    disk_delta: DiskDeltaSpec = Field(default_factory=DiskDeltaSpec, json_schema_extra=EMPTY_DEFAULT)
    """Settings of the disk-delta transport (used when it is chosen)."""


# ------------------------------------------------------------------------------------------- schedule


class ScheduleMode(enum.StrEnum):
    """How generation and training interleave."""

    SYNC = "sync"
    FULLY_ASYNC = "fully-async"


class ScheduleSpec(ApiModel):
    """The loop: how generation and training overlap, how long, and when to save and evaluate."""

    mode: ScheduleMode = ScheduleMode.SYNC
    """`sync` (generate a batch, train, update) or `fully-async` (a persistent producer fills a
    bounded buffer while the trainer consumes it; needs separate GPUs)."""
    colocate: bool = False
    """Engines and trainer share GPUs and take turns (weights offloaded in between)."""
    max_weight_staleness: int | None = Field(default=None, ge=0, le=1000000)
    """Drop groups whose oldest token lags the current version by more than this (fully-async only);
    unset keeps every group (the bounded queue still applies back-pressure)."""
    steps: int = Field(default=100, ge=1, le=100000000)
    """Optimizer steps to run."""
    save_interval: int | None = Field(default=None, ge=1, le=100000000)
    """Save a checkpoint every this many steps; unset saves only at the end."""
    eval_interval: int | None = Field(default=None, ge=1, le=100000000)
    """Evaluate on data.evalPrompts every this many steps; unset never evaluates."""
    eval_temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    """Sampling temperature of evaluation; 0 is greedy decoding."""
    buffer_groups: int | None = Field(default=None, ge=1, le=1048576)
    """Capacity in groups of the fully-async buffer between rollout and trainer; unset is
    2 x algorithm.batchSize."""


# ------------------------------------------------------------------------------------ data and agent


class DataSpec(ApiModel):
    """Where prompts come from."""

    prompts: str = Field(min_length=1, max_length=1024)
    """Prompt source: a JSON-lines file or directory, a local Hugging Face dataset directory (`DIR`,
    `DIR:split` or `DIR:config:split`), a hub dataset id (`org/name[@rev][:config][:split]`), or
    `builtin:<task>` for a task that ships with Lockstep."""
    eval_prompts: str | None = Field(default=None, max_length=1024)
    """Held-out prompt source for evaluation (same forms)."""
    shuffle: bool = True
    """Shuffle user prompts (files, datasets) in a new seeded order every epoch; a resumed run draws
    the same prompts as an uninterrupted one. Built-in tasks draw each prompt from the seed already."""
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    """Seed of the shuffle and of sampling."""


class AgentSpec(ApiModel):
    """User code: the agent loop, the generate function and the reward, by import path."""

    image: str | None = Field(default=None, max_length=512)
    """Image with the user code (the driver's image when unset)."""
    agent_function: str | None = Field(default=None, max_length=256, pattern=IMPORT_PATH_PATTERN)
    """`module:function` running one multi-turn episode against the session server."""
    generate_function: str | None = Field(default=None, max_length=256, pattern=IMPORT_PATH_PATTERN)
    """`module:function` replacing the default single-turn generate."""
    reward_function: str | None = Field(default=None, max_length=256, pattern=IMPORT_PATH_PATTERN)
    """`module:function` scoring a sample; unset uses the task's built-in reward."""
    max_turns: int | None = Field(default=None, ge=1, le=100000)
    """End an episode after this many turns."""
    timeout_seconds: int | None = Field(default=None, ge=1, le=604800)
    """End an episode after this long."""
    group_filter_function: str | None = Field(default=None, max_length=256, pattern=IMPORT_PATH_PATTERN)
    """`module:function` taking a Group and returning True to keep it; applied when a complete group
    enters the fully-async buffer (unset keeps every group)."""


# ------------------------------------------------------------------------------------------ placement


class GPUProduct(enum.StrEnum):
    """GPU product the pods need (matched on nvidia.com/gpu.product)."""

    GB300 = "GB300"
    H100 = "H100"
    ANY = "any"


class GangSchedulerName(enum.StrEnum):
    """Which gang scheduler admits the job's pods all at once."""

    NONE = "none"
    VOLCANO = "volcano"
    KUEUE = "kueue"
    SCHEDULER_PLUGINS = "scheduler-plugins"


class Toleration(ApiModel):
    """A Kubernetes toleration."""

    key: str | None = Field(default=None, max_length=316)
    """Taint key; unset with operator Exists matches every taint."""
    operator: Literal["Equal", "Exists"] = "Equal"
    """Equal or Exists."""
    value: str | None = Field(default=None, max_length=63)
    """Taint value for Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; unset matches all."""
    toleration_seconds: int | None = Field(default=None, ge=0)
    """For NoExecute: how long the pod stays bound after the taint appears."""


class GangScheduling(ApiModel):
    """Gang scheduling of all pods of the job as one group."""

    scheduler: GangSchedulerName = GangSchedulerName.NONE
    """`none`, `volcano`, `kueue` or `scheduler-plugins` (coscheduling)."""
    queue_name: str | None = Field(default=None, max_length=253)
    """Queue of the scheduler (required for kueue)."""


class PlacementSpec(ApiModel):
    """Where the pods go."""

    gpu_product: GPUProduct = GPUProduct.ANY
    """GPU product: `GB300`, `H100` or `any`."""
    node_selector: dict[str, Label] = Field(default_factory=dict, max_length=32)
    """Extra node labels every pod requires."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Tolerations of every pod."""
    gang: GangScheduling = Field(default_factory=GangScheduling, json_schema_extra=EMPTY_DEFAULT)
    """Gang scheduler integration."""


# ---------------------------------------------------------------------------------------------- RLJob


class RLJobSpec(ApiModel):
    """Desired state of an RL post-training job."""

    model: ModelSpec
    """The policy model (immutable)."""
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, json_schema_extra=EMPTY_DEFAULT)
    """The objective: advantages, group size, batch, learning rate, KL, mismatch correction, R3,
    true-on-policy, OPD."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, json_schema_extra=EMPTY_DEFAULT)
    """Rollout engines, sampling and the session server."""
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, json_schema_extra=EMPTY_DEFAULT)
    """The trainer (backend immutable)."""
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec, json_schema_extra=EMPTY_DEFAULT)
    """How weights reach the engines."""
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec, json_schema_extra=EMPTY_DEFAULT)
    """Sync or fully-async, colocation, staleness bound, steps, save and eval intervals."""
    data: DataSpec
    """Prompt source."""
    agent: AgentSpec = Field(default_factory=AgentSpec, json_schema_extra=EMPTY_DEFAULT)
    """User agent, generate and reward functions."""
    placement: PlacementSpec = Field(default_factory=PlacementSpec, json_schema_extra=EMPTY_DEFAULT)
    """Node selection and gang scheduling."""
    suspend: bool = False
    """Suspend the job: pods are deleted, progress is kept (Kueue sets this)."""
    active_deadline_seconds: int | None = Field(default=None, ge=1, le=31536000)
    """Fail the job when it has run this long."""
    backoff_limit: int = Field(default=3, ge=0, le=1000)
    """Restarts (from the last checkpoint) before the job fails."""


class Phase(enum.StrEnum):
    """Where a job is in its life."""

    PENDING = "Pending"
    PROVISIONING = "Provisioning"
    PREFLIGHT = "Preflight"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class RLJobStatus(ApiModel):
    """Observed state of an RL job, written by the operator and the driver."""

    phase: Phase | None = None
    """Pending, Provisioning, Preflight, Running, Suspended, Succeeded or Failed."""
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Conditions: Admitted, PreflightPassed, WeightChannelReady, Progressing, Degraded, Suspended,
    Complete, Failed."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The metadata.generation the status describes."""
    step: int | None = Field(default=None, ge=0)
    """Optimizer steps done."""
    weight_version: int | None = Field(default=None, ge=0)
    """The weight version all engines hold."""
    reward: float | None = None
    """Moving average of the raw reward."""
    staleness: int | None = Field(default=None, ge=0)
    """Largest staleness S_old (versions) of the groups of the last step."""
    avg_staleness: float | None = Field(default=None, ge=0.0)
    """Token-weighted mean staleness of the last step."""
    queue_size: int | None = Field(default=None, ge=0)
    """Complete groups waiting in the buffer."""
    transport: str | None = Field(default=None, max_length=32)
    """The weight transport in use."""
    transport_reason: str | None = Field(default=None, max_length=1024)
    """Why that transport was chosen."""
    restarts: int | None = Field(default=None, ge=0)
    """Restarts so far."""
    start_time: dt.datetime | None = None
    """When the job started running."""
    completion_time: dt.datetime | None = None
    """When the job succeeded or failed."""


class RLJob(KubeObject):
    """An RL post-training job: the policy model, how it samples (rollout), learns (algorithm,
    trainer), moves weights (weightSync) and loops (schedule). The operator runs it as a RolloutPool,
    a TrainerGroup and a WeightChannel; `lockstep run` runs it on one machine."""

    api_version: Literal["rl.lockstep.dev/v1alpha1"] = "rl.lockstep.dev/v1alpha1"
    """rl.lockstep.dev/v1alpha1"""
    kind: Literal["RLJob"] = "RLJob"
    """RLJob"""
    spec: RLJobSpec
    """Desired state: model, algorithm, rollout, trainer, weightSync, schedule, data, agent, placement."""
    status: RLJobStatus | None = None
    """Observed state, written by the operator and the driver."""
