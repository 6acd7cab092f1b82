"""The cross-field rules of the Lockstep API, each declared once for CEL and for Python.

Why it exists: some combinations cannot keep their promise (§10: fail early). Each rule here is
one `Rule`: the model it sits on (its scope), one expression in lockstep.api.cel, the field to blame and
a message that names the fix. lockstep.api.crdgen emits the expression as CEL into the CRD
(x-kubernetes-validations, so `kubectl apply` refuses the object) and `check_rules` evaluates the same
expression in Python (so `lockstep validate` and `lockstep run` refuse it offline, with the same
message). Field-level limits (enums, minimums, lengths) live on the fields themselves.

Who uses it: lockstep.api.crdgen, lockstep.api.manifest, docs/api.md (the table of rules), tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from pydantic import BaseModel

from lockstep.api.cel import Expr, field, has, has_var, lit, old, var
from lockstep.api.common import NAME_PATTERN, KubeObject
from lockstep.api.profiles import (
    SGLANG_KERNEL_PROFILES,
    TRUE_ON_POLICY_FAMILIES,
    TRUE_ON_POLICY_PROFILES,
    registered_names,
)
from lockstep.api.rljob import (
    AlgorithmSpec,
    Autoscaling,
    EngineSpec,
    GangScheduling,
    KVCacheDtype,
    LocalDiskSpec,
    MismatchSpec,
    ModelSpec,
    OPDSpec,
    RLJobSpec,
    RolloutSpec,
    SamplingSpec,
    SFTWarmStartSpec,
    Teacher,
    TrainerSpec,
)
from lockstep.api.rolloutpool import RolloutPoolSpec

WEIGHT_STREAMING_TRANSPORTS: Final[list[str]] = ["p2p", "disk-delta"]
MEGATRON_FAMILIES: Final[tuple[str, ...]] = ("tiny", "qwen3")
"""spec.model.family values the megatron backend builds (lockstep.train.megatron.config: Qwen3 and
Qwen3-MoE architectures; the tiny family is a Qwen3)."""
SESSION_FAMILIES: Final[tuple[str, ...]] = ("glm47", "glm5", "qwen3", "tiny")
"""Families the TITO session server knows the chat boundaries of (lockstep.models.families; a test keeps
the two lists equal): a multi-turn agent's turns are merged and split by them."""


@dataclass(frozen=True, slots=True)
class Rule:
    """A rule that must hold on every object of type `scope` (and its subclasses)."""

    name: str
    """Short stable id, used in tests and docs."""
    scope: type[BaseModel]
    """The model the rule sits on; CEL `self` is that object."""
    expr: Expr
    """What must be true."""
    field: str
    """Dotted camelCase path, relative to the scope, of the field to blame ("" for the scope itself)."""
    message: str
    """What is wrong and how to fix it."""
    transition: bool = False
    """Compares with the previous object (`oldSelf`); checked on update only."""
    cel_field_path: bool = True
    """Emit `field` as the CEL fieldPath; off for metadata, which the CRD schema does not describe."""

    def x_kubernetes_validation(self) -> dict[str, Any]:
        """The CRD x-kubernetes-validations entry."""
        out: dict[str, Any] = {"rule": self.expr.to_cel(), "message": self.message}
        if self.field and self.cel_field_path:
            out["fieldPath"] = "." + self.field
        out["reason"] = "FieldValueForbidden" if self.transition else "FieldValueInvalid"
        return out


# Sub-expressions shared by several rules (paths relative to the rule's scope).
_mode, _colocate = field("schedule.mode"), field("schedule.colocate")
_transport = field("weightSync.transport")
_streaming = _transport.in_(WEIGHT_STREAMING_TRANSPORTS)
_world = field("nodes") * field("gpusPerNode")
_par = "parallelism."
# RLJob's spec.rollout and a RolloutPool's spec hold the same replicas/autoscaling pair.
_REPLICAS_WITHIN_AUTOSCALING = has("autoscaling").implies(
    field("replicas").ge(field("autoscaling.minReplicas"))
    & field("replicas").le(field("autoscaling.maxReplicas"))
)
RULES: Final[tuple[Rule, ...]] = (
    Rule(
        "name-is-a-label",
        KubeObject,
        field("metadata.name").matches(NAME_PATTERN) & field("metadata.name").size().le(63),
        "metadata.name",
        "metadata.name must be a DNS-1123 label (it prefixes pod and service names): at most 63 "
        "lowercase letters, digits and '-', starting and ending with a letter or digit",
        cel_field_path=False,
    ),
    Rule(
        "fully-async-colocate",
        RLJobSpec,
        ~(_mode.eq("fully-async") & _colocate.eq(True)),
        "schedule.colocate",
        "fully-async needs separate GPUs for rollout and training: set schedule.colocate to false "
        "or schedule.mode to sync",
    ),
    Rule(
        "staleness-needs-fully-async",
        RLJobSpec,
        has("schedule.maxWeightStaleness").implies(_mode.eq("fully-async")),
        "schedule.maxWeightStaleness",
        "maxWeightStaleness bounds the fully-async buffer: remove it or set schedule.mode to fully-async",
    ),
    Rule(
        "streaming-transport-colocate",
        RLJobSpec,
        _streaming.implies(_colocate.eq(False)),
        "weightSync.transport",
        "p2p and disk-delta do not support colocated engines: use transport cuda-ipc or auto, or "
        "set schedule.colocate to false",
    ),
    Rule(
        "streaming-transport-lora",
        RLJobSpec,
        _streaming.implies(~has("model.lora")),
        "weightSync.transport",
        "p2p and disk-delta move full weight tensors and cannot carry an adapter: use transport auto, "
        "broadcast or cuda-ipc (the adapter goes to SGLang's /load_lora_adapter routes), or remove "
        "model.lora",
    ),
    Rule(
        "shared-pool-needs-lora",
        RLJobSpec,
        has("rollout.poolRef").implies(has("model.lora")),
        "rollout.poolRef",
        "a shared rollout pool serves one base model to several jobs, which must never write it: set "
        "model.lora (each job trains its own adapter), or remove rollout.poolRef",
    ),
    Rule(
        "lora-needs-fsdp",
        RLJobSpec,
        has("model.lora").implies(field("trainer.backend").eq("fsdp")),
        "trainer.backend",
        "LoRA is built on the fsdp backend only (peft adapters; the megatron backend trains all weights): "
        "set trainer.backend to fsdp, or remove model.lora",
    ),
    Rule(
        "lora-true-on-policy-not-built",
        RLJobSpec,
        has("model.lora").implies(field("algorithm.trueOnPolicy").eq(False)),
        "algorithm.trueOnPolicy",
        "true on-policy with LoRA is not built yet (the batch-invariant kernels do not cover the adapter's "
        "matmuls): set algorithm.trueOnPolicy to false, or remove model.lora",
    ),
    Rule(
        "lora-quantized-serving-not-built",
        RLJobSpec,
        has("model.lora").implies(
            field("rollout.precision").eq("bf16") & field("trainer.precision").eq("bf16")
        ),
        "rollout.precision",
        "LoRA with low-precision serving or training is not built yet (the adapter would be applied to "
        "quantized base weights the trainer never sees): set rollout.precision and trainer.precision to "
        "bf16, or remove model.lora",
    ),
    Rule(
        "streaming-transport-prefill-decode",
        RLJobSpec,
        _streaming.implies(field("rollout.prefillDecode").eq(False)),
        "weightSync.transport",
        "p2p and disk-delta do not support prefill-decode disaggregation: use transport broadcast "
        "or auto, or set rollout.prefillDecode to false",
    ),
    Rule(
        "cuda-ipc-needs-colocate",
        RLJobSpec,
        _transport.eq("cuda-ipc").implies(_colocate.eq(True)),
        "weightSync.transport",
        "cuda-ipc shares GPU memory, so engines and trainer must share GPUs: set "
        "schedule.colocate to true or use transport auto",
    ),
    Rule(
        "nvfp4-serving-needs-nvfp4-training",
        RLJobSpec,
        field("rollout.precision").eq("nvfp4").implies(field("trainer.precision").eq("nvfp4")),
        "rollout.precision",
        "NVFP4 serving needs NVFP4 training (every stage that touches weights must quantize "
        "alike): set trainer.precision to nvfp4 or serve bf16, fp8 or mxfp8",
    ),
    Rule(
        "trainer-precision-matches-serving",
        RLJobSpec,
        field("trainer.precision").eq("bf16") | field("trainer.precision").eq(field("rollout.precision")),
        "trainer.precision",
        "a low-precision trainer must serve the same format (a quantized forward against other serving "
        "weights is a different policy): set trainer.precision to bf16 or to rollout.precision",
    ),
    Rule(
        "true-on-policy-profile",
        RLJobSpec,
        field("algorithm.trueOnPolicy")
        .eq(True)
        .implies(
            field("model.family").in_(list(TRUE_ON_POLICY_FAMILIES))
            | (
                has("model.variant")
                & (field("model.family") + "-" + field("model.variant")).in_(list(TRUE_ON_POLICY_PROFILES))
            )
        ),
        "algorithm.trueOnPolicy",
        "true-on-policy has profiles only for the models "
        + registered_names()
        + " (lockstep.api.profiles): set algorithm.trueOnPolicy to false or use a registered model",
    ),
    Rule(
        "true-on-policy-sglang-kernels",
        RLJobSpec,
        (field("algorithm.trueOnPolicy").eq(True) & field("rollout.engine").eq("sglang")).implies(
            has("model.variant")
            & (field("model.family") + "-" + field("model.variant")).in_(list(SGLANG_KERNEL_PROFILES))
        ),
        "rollout.engine",
        "true-on-policy against stock SGLang needs a trainer that computes as SGLang does, built for "
        + ", ".join(SGLANG_KERNEL_PROFILES)
        + " (lockstep.numerics.sglang_kernels): set rollout.engine to reference or use one of these models",
    ),
    Rule(
        "true-on-policy-sglang-bf16",
        RLJobSpec,
        (field("algorithm.trueOnPolicy").eq(True) & field("rollout.engine").eq("sglang")).implies(
            field("rollout.precision").eq("bf16")
        ),
        "rollout.precision",
        "the trainer reproduces SGLang's bf16 path only (its FP8 / MXFP8 / NVFP4 GEMMs are other kernels): "
        "set rollout.precision to bf16 with trueOnPolicy against SGLang, or rollout.engine to reference",
    ),
    Rule(
        "true-on-policy-sglang-one-gpu-per-layer",
        RLJobSpec,
        (field("algorithm.trueOnPolicy").eq(True) & field("rollout.engine").eq("sglang")).implies(
            field("rollout.tensorParallel").eq(1)
        ),
        "rollout.tensorParallel",
        "SGLang's on-policy target `fsdp` has no tensor-parallel form (a row-parallel layer adds its shards' "
        "partial sums in another order than the trainer's whole matmul): set rollout.tensorParallel to 1 "
        "with trueOnPolicy against SGLang",
    ),
    Rule(
        "true-on-policy-fsdp",
        RLJobSpec,
        field("algorithm.trueOnPolicy").eq(True).implies(field("trainer.backend").eq("fsdp")),
        "trainer.backend",
        "true-on-policy runs on the fsdp backend only: set trainer.backend to fsdp or "
        "algorithm.trueOnPolicy to false",
    ),
    Rule(
        "true-on-policy-same-device",
        RLJobSpec,
        field("algorithm.trueOnPolicy")
        .eq(True)
        .implies(field("rollout.gpusPerEngine").gt(0).eq(field("trainer.device").eq("cuda"))),
        "algorithm.trueOnPolicy",
        "the engines and the trainer must run on the same device type (the exact kernels are exact per "
        "device): set rollout.gpusPerEngine to 0 with trainer.device cpu, or above 0 with trainer.device cuda",
    ),
    Rule(
        "true-on-policy-no-fp8-kv",
        RLJobSpec,
        field("algorithm.trueOnPolicy")
        .eq(True)
        .implies(
            ~field("rollout.kvCacheDtype").in_([d.value for d in KVCacheDtype if d.value.startswith("fp8")])
        ),
        "rollout.kvCacheDtype",
        "an FP8 KV cache rounds the engine's keys and values, which the trainer does not: set "
        "rollout.kvCacheDtype to auto with trueOnPolicy, or trueOnPolicy to false",
    ),
    Rule(
        "in-flight-holds-a-group",
        RLJobSpec,
        field("rollout.maxInFlight").ge(field("algorithm.samplesPerPrompt")),
        "rollout.maxInFlight",
        "a whole group is submitted at a time: raise rollout.maxInFlight to at least "
        "algorithm.samplesPerPrompt",
    ),
    Rule(
        "eval-needs-prompts",
        RLJobSpec,
        has("schedule.evalInterval").implies(has("data.evalPrompts")),
        "schedule.evalInterval",
        "evaluation needs held-out prompts: set data.evalPrompts or remove schedule.evalInterval",
    ),
    Rule(
        "lr-warmup-within-steps",
        RLJobSpec,
        field("algorithm.lrSchedule.warmupSteps").lt(field("schedule.steps")),
        "algorithm.lrSchedule.warmupSteps",
        "the learning-rate warmup must end before the last step: lower "
        "algorithm.lrSchedule.warmupSteps below schedule.steps",
    ),
    Rule(
        "dynamic-sampling-needs-sync",
        RLJobSpec,
        has("algorithm.dynamicSampling").implies(_mode.eq("sync")),
        "algorithm.dynamicSampling",
        "dynamic sampling is built for the sync schedule: remove algorithm.dynamicSampling or set "
        "schedule.mode to sync (fully-async jobs drop groups with agent.groupFilterFunction)",
    ),
    Rule(
        "local-disk-ephemeral-size",
        LocalDiskSpec,
        field("source").eq("ephemeral").implies(has("size")),
        "size",
        "an ephemeral local disk is a volume claim created with each rank pod: set "
        "trainer.localDisk.size (e.g. 500Gi), or use source hostPath for the node's own directory",
    ),
    Rule(
        "local-disk-host-path-as-is",
        LocalDiskSpec,
        field("source").eq("hostPath").implies(~has("size") & ~has("storageClassName")),
        "source",
        "size and storageClassName describe an ephemeral volume; a hostPath is the node's directory as it "
        "is: remove them, or set trainer.localDisk.source to ephemeral",
    ),
    Rule(
        "local-disk-has-a-use",
        TrainerSpec,
        has("localDisk").implies(field("offload").eq("disk") | field("streamOptimizerStateToDisk").eq(True)),
        "localDisk",
        "trainer.localDisk holds offloaded state (offload: disk) and streamed optimizer state "
        "(streamOptimizerStateToDisk: true): set one of them, or remove localDisk",
    ),
    Rule(
        "trainer-parallelism-divides-gpus",
        TrainerSpec,
        (_world % (field(_par + "tensor") * field(_par + "pipeline") * field(_par + "context"))).eq(0),
        "parallelism",
        "tensor x pipeline x context parallel must divide nodes x gpusPerNode: change "
        "trainer.parallelism or the trainer's GPU count",
    ),
    Rule(
        "trainer-expert-parallelism-divides-gpus",
        TrainerSpec,
        ((_world // field(_par + "pipeline")) % (field(_par + "expert") * field(_par + "expertTensor"))).eq(
            0
        ),
        "parallelism.expert",
        "expert x expertTensor parallel must divide (nodes x gpusPerNode) / pipeline (EP reuses the "
        "same ranks, it does not multiply GPUs): change trainer.parallelism.expert",
    ),
    Rule(
        "megatron-needs-cuda",
        TrainerSpec,
        field("device").eq("cpu").implies(field("backend").eq("fsdp")),
        "device",
        "the megatron backend needs CUDA: set trainer.backend to fsdp for cpu ranks, or device to cuda",
    ),
    Rule(
        "fsdp-data-parallel-only",
        TrainerSpec,
        field("backend")
        .eq("fsdp")
        .implies(
            field(_par + "tensor").eq(1)
            & field(_par + "pipeline").eq(1)
            & field(_par + "context").eq(1)
            & field(_par + "expert").eq(1)
            & field(_par + "expertTensor").eq(1)
        ),
        "parallelism",
        "the fsdp backend is data parallel only (FSDP2 shards every parameter over all ranks): set "
        "trainer.parallelism's sizes to 1, or trainer.backend to megatron",
    ),
    Rule(
        "megatron-trains-bf16",
        TrainerSpec,
        field("backend").eq("megatron").implies(field("precision").eq("bf16")),
        "precision",
        "the megatron backend trains bf16 (with fp32 master weights); low-precision training needs "
        "Transformer Engine, which is not built in: set trainer.precision to bf16 or trainer.backend to fsdp",
    ),
    Rule(
        "stream-optimizer-state-megatron",
        TrainerSpec,
        field("streamOptimizerStateToDisk").eq(True).implies(field("backend").eq("megatron")),
        "streamOptimizerStateToDisk",
        "optimizer state streamed from disk is built in the megatron backend: set "
        "trainer.streamOptimizerStateToDisk to false or trainer.backend to megatron",
    ),
    Rule(
        "fsdp-offload-not-disk",
        TrainerSpec,
        field("offload").eq("disk").implies(field("backend").eq("megatron")),
        "offload",
        "fsdp offloads to host memory only: set trainer.offload to cpu or trainer.backend to megatron",
    ),
    Rule(
        "backend-immutable",
        TrainerSpec,
        field("backend").eq(old("backend")),
        "backend",
        "the trainer backend cannot change after creation: create a new job",
        transition=True,
    ),
    Rule(
        "model-immutable",
        ModelSpec,
        field("checkpoint").eq(old("checkpoint")) & field("family").eq(old("family")),
        "checkpoint",
        "the model cannot change after creation: create a new job",
        transition=True,
    ),
    Rule(
        "engine-tp-divides-gpus",
        EngineSpec,
        (field("gpusPerEngine") % field("tensorParallel")).eq(0),
        "tensorParallel",
        "tensorParallel must divide gpusPerEngine: change one of them",
    ),
    Rule(
        "engine-dp-attention-divides-tp",
        EngineSpec,
        (field("tensorParallel") % field("dataParallelAttention")).eq(0),
        "dataParallelAttention",
        "dataParallelAttention must divide tensorParallel: change one of them",
    ),
    Rule(
        "replicas-within-autoscaling",
        RolloutSpec,
        _REPLICAS_WITHIN_AUTOSCALING,
        "replicas",
        "replicas must lie within autoscaling.minReplicas..maxReplicas: change replicas or the bounds",
    ),
    Rule(
        "pool-replicas-within-autoscaling",
        RolloutPoolSpec,
        _REPLICAS_WITHIN_AUTOSCALING,
        "replicas",
        "replicas must lie within autoscaling.minReplicas..maxReplicas: scale within the bounds or "
        "change them",
    ),
    Rule(
        "autoscaling-bounds-ordered",
        Autoscaling,
        field("minReplicas").le(field("maxReplicas")),
        "minReplicas",
        "minReplicas must not exceed maxReplicas: swap or fix them",
    ),
    Rule(
        "lr-min-below-lr",
        AlgorithmSpec,
        field("lrSchedule.minLearningRate").le(field("learningRate")),
        "lrSchedule.minLearningRate",
        "the learning-rate decay ends at minLearningRate, which must not exceed learningRate: lower "
        "lrSchedule.minLearningRate",
    ),
    Rule(
        "dynamic-sampling-covers-batch",
        AlgorithmSpec,
        has("dynamicSampling").implies(field("dynamicSampling.maxGroupsPerStep").ge(field("batchSize"))),
        "dynamicSampling.maxGroupsPerStep",
        "dynamic sampling generates at least one batch per step: raise "
        "dynamicSampling.maxGroupsPerStep to at least algorithm.batchSize",
    ),
    Rule(
        "sft-stop-needs-steps",
        SFTWarmStartSpec,
        has("stopAtLoss").implies(field("steps").gt(0)),
        "stopAtLoss",
        "stopAtLoss ends a warm start that must run: set sftWarmStart.steps (the most SFT steps) above 0 "
        "or remove stopAtLoss",
    ),
    Rule(
        "mismatch-bounds-ordered",
        MismatchSpec,
        field("low").lt(field("high")),
        "low",
        "the mismatch interval needs low < high (default [0, 2]): fix low or high",
    ),
    Rule(
        "opd-default-teacher-exists",
        OPDSpec,
        has("defaultTeacher").implies(field("defaultTeacher").in_(field("teachers").map("name"))),
        "defaultTeacher",
        "defaultTeacher must name one of the teachers: fix the name or add that teacher",
    ),
    Rule(
        "opd-teacher-one-source",
        Teacher,
        (has("url") & ~has("checkpoint") & ~has("poolRef"))
        | (~has("url") & has("checkpoint") & ~has("poolRef"))
        | (~has("url") & ~has("checkpoint") & has("poolRef")),
        "",
        "a teacher is served from exactly one place: set one of url (an SGLang server), checkpoint (a pool "
        "the operator runs) and poolRef (a standalone RolloutPool), and remove the others",
    ),
    Rule(
        "opd-replicas-need-checkpoint",
        Teacher,
        field("replicas").eq(1) | has("checkpoint"),
        "replicas",
        "replicas sizes the pool the operator runs for a checkpoint teacher; a url or poolRef teacher is "
        "scaled where it is served: remove replicas",
    ),
    Rule(
        "opd-label-one-teacher",
        OPDSpec,
        field("teachers").all(
            "t",
            ~has_var("t", "labels")
            | field("labels", "t").all(
                "l",
                field("teachers").exists_one(
                    "u", has_var("u", "labels") & var("l").in_(field("labels", "u"))
                ),
            ),
        ),
        "teachers",
        "each sample goes to exactly one teacher: a label may appear in the labels of one teacher only "
        "(multi-teacher OPD routes, it does not ensemble)",
    ),
    Rule(
        "opd-every-teacher-routed",
        OPDSpec,
        field("teachers").all(
            "t",
            (has_var("t", "labels") & field("labels", "t").size().gt(0))
            | (has("defaultTeacher") & field("defaultTeacher").eq(field("name", "t"))),
        ),
        "teachers",
        "a teacher that no label routes to and that is not defaultTeacher would score nothing: give it "
        "labels, or name it in defaultTeacher (a single teacher: defaultTeacher: <its name>)",
    ),
    Rule(
        "opd-teacher-pool-not-rollout-pool",
        RLJobSpec,
        (has("algorithm.opd") & has("rollout.poolRef")).implies(
            field("algorithm.opd.teachers").all(
                "t", ~has_var("t", "poolRef") | ~field("poolRef.name", "t").eq(field("rollout.poolRef.name"))
            )
        ),
        "algorithm.opd.teachers",
        "a teacher's poolRef names the job's own rollout.poolRef: a pool serves rollouts (updated by its "
        "jobs) or a teacher (never updated), not both: give the teacher a pool of role teacher",
    ),
    Rule(
        "opd-builtin-label-routed",
        RLJobSpec,
        (
            has("algorithm.opd")
            & ~has("algorithm.opd.defaultTeacher")
            & field("data.prompts").matches("^builtin:")
            & field("algorithm.opd.labelKey").eq("label")
        ).implies(
            field("algorithm.opd.teachers").exists(
                "t",
                has_var("t", "labels")
                & field("labels", "t").exists("l", (lit("builtin:") + var("l")).eq(field("data.prompts"))),
            )
        ),
        "algorithm.opd.defaultTeacher",
        "every sample of a built-in task carries the task's name as its label (builtin:reverse: reverse) "
        "and no teacher lists it: add the label to a teacher's labels or set defaultTeacher",
    ),
    Rule(
        "opd-temperature-one",
        RLJobSpec,
        has("algorithm.opd").implies(field("rollout.sampling.temperature").eq(1.0)),
        "rollout.sampling.temperature",
        "OPD compares the student's sampling distribution with the teacher's, which scores at temperature "
        "1 (SGLang's input logprobs): set rollout.sampling.temperature to 1.0",
    ),
    Rule(
        "sft-no-sampling",
        RLJobSpec,
        field("recipe")
        .eq("sft")
        .implies(
            ~has("algorithm.opd")
            & field("algorithm.r3").eq(False)
            & field("algorithm.trueOnPolicy").eq(False)
            & ~has("algorithm.dynamicSampling")
            & field("algorithm.kl.coef").eq(0.0)
            & field("algorithm.sftWarmStart.steps").eq(0)
        ),
        "recipe",
        "an sft job trains on its data and samples nothing: remove algorithm.opd, r3, trueOnPolicy, "
        "dynamicSampling, kl.coef and sftWarmStart (or set recipe to rl)",
    ),
    Rule(
        "sft-no-agent",
        RLJobSpec,
        field("recipe")
        .eq("sft")
        .implies(~has("agent.agentFunction") & ~has("agent.generateFunction") & ~has("agent.rewardFunction")),
        "agent",
        "an sft job runs no agent, generate or reward function: remove them from spec.agent (or set "
        "recipe to rl)",
    ),
    Rule(
        "sft-sync",
        RLJobSpec,
        field("recipe")
        .eq("sft")
        .implies(_mode.eq("sync") & field("weightSync.checkWeightUpdateEqual").eq(False)),
        "schedule.mode",
        "an sft job has no engines to overlap with or to check weights on: set schedule.mode to sync and "
        "weightSync.checkWeightUpdateEqual to false",
    ),
    Rule(
        "sft-eval-not-built",
        RLJobSpec,
        field("recipe").eq("sft").implies(~has("schedule.evalInterval")),
        "schedule.evalInterval",
        "evaluation of an sft job (held-out loss) is not built yet: remove schedule.evalInterval",
    ),
    Rule(
        "fully-async-no-abort",
        RLJobSpec,
        _mode.eq("fully-async").implies(~field("weightSync.pauseMode").eq("abort")),
        "weightSync.pauseMode",
        "fully-async keeps trajectories in flight across every weight update, and abort would drop "
        "their groups: set weightSync.pauseMode to retract (the default) or schedule.mode to sync",
    ),
    Rule(
        "cuda-ipc-one-engine",
        RLJobSpec,
        _transport.eq("cuda-ipc").implies(field("rollout.replicas").le(1)),
        "rollout.replicas",
        "cuda-ipc hands weights to the one colocated engine: set rollout.replicas to 1 or use "
        "transport broadcast or auto",
    ),
    Rule(
        "p2p-needs-a-receiver",
        RLJobSpec,
        (_transport.eq("p2p") & field("rollout.engine").eq("sglang")).implies(
            field("rollout.p2pReceiver").eq(True)
        ),
        "rollout.p2pReceiver",
        "p2p writes into the engines through Lockstep's P2P receive extension, which stock SGLang does "
        "not serve (docs/sglang.md): set weightSync.transport to broadcast or auto, or set "
        "rollout.p2pReceiver to true for an engine image that serves it",
    ),
    # Not built yet: the API keeps these fields, the runtime does not build them, so a manifest that
    # asks for one is refused at apply, never at pod start. Each rule goes when its feature is built.
    Rule(
        "megatron-families-built",
        RLJobSpec,
        field("trainer.backend").eq("megatron").implies(field("model.family").in_(list(MEGATRON_FAMILIES))),
        "model.family",
        "the megatron backend builds the Qwen3 and Qwen3-MoE architectures only (families "
        + ", ".join(MEGATRON_FAMILIES)
        + "); GLM's MLA/DSA attention is not built in it (docs/megatron.md): set trainer.backend to fsdp, "
        "which builds every family through transformers",
    ),
    Rule(
        "prefill-decode-not-built",
        EngineSpec,
        field("prefillDecode").eq(False),
        "prefillDecode",
        "prefill-decode disaggregation is not built yet (engines are rendered as one server each): "
        "set prefillDecode to false",
    ),
    Rule(
        "mtp-needs-sglang",
        EngineSpec,
        field("multiTokenPrediction").eq(True).implies(field("engine").eq("sglang")),
        "multiTokenPrediction",
        "multi-token prediction is SGLang's speculative decoding; the reference engine has none: set "
        "engine to sglang or multiTokenPrediction to false",
    ),
    Rule(
        "agent-needs-a-session-family",
        RLJobSpec,
        has("agent.agentFunction").implies(field("model.family").in_(list(SESSION_FAMILIES))),
        "model.family",
        "a multi-turn agent runs through the TITO session server, which knows the chat boundaries of "
        "the families " + ", ".join(SESSION_FAMILIES) + " only (every turn of another family would fail "
        "and train nothing): set model.family to one of them, or remove agent.agentFunction",
    ),
    Rule(
        "extra-args-no-key",
        EngineSpec,
        # guarded: a manifest that leaves extraArgs out has no such key on the apiserver (no default there)
        has("extraArgs").implies(
            ~lit("--api-key").in_(field("extraArgs")) & ~lit("--config").in_(field("extraArgs"))
        ),
        "extraArgs",
        "extraArgs may not set --api-key or --config: the job's key reaches the engine from its Secret "
        "through the config file the pod writes (never a command-line flag, which SGLang logs): remove them",
    ),
    Rule(
        "session-token-cap-not-built",
        SamplingSpec,
        ~has("maxSessionTokens"),
        "maxSessionTokens",
        "a whole-session token cap is not built yet (maxNewTokens caps each turn, agent.maxTurns the "
        "turns): remove rollout.sampling.maxSessionTokens",
    ),
    Rule(
        "context-parallel-not-built",
        TrainerSpec,
        field(_par + "context").eq(1),
        "parallelism.context",
        "context parallelism is not built yet (megatron-core's local layer spec has no "
        "context-parallel attention without Transformer Engine): set trainer.parallelism.context to 1",
    ),
    Rule(
        "kueue-needs-queue",
        GangScheduling,
        field("scheduler").eq("kueue").implies(has("queueName")),
        "queueName",
        "kueue admits workloads through a LocalQueue: set placement.gang.queueName",
    ),
)
"""Every cross-field rule of the API."""


def rules_for(model: type[BaseModel]) -> list[Rule]:
    """The rules that sit on `model` (a rule on a base class applies to its subclasses too)."""
    return [rule for rule in RULES if issubclass(model, rule.scope)]


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a manifest: where, what value, what to do."""

    path: str
    """Dotted wire path, e.g. spec.schedule.colocate."""
    value: Any
    """The offending value (JSON form), or None."""
    message: str
    """What to do."""

    def __str__(self) -> str:
        shown = json.dumps(self.value, separators=(",", ":"))
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return f"{self.path}: {shown}: {self.message}"


def walk(obj: BaseModel, path: str) -> Iterator[tuple[str, BaseModel]]:
    """Every model inside obj (itself included), with its dotted wire path."""
    yield path, obj
    for name, info in type(obj).model_fields.items():
        value = getattr(obj, name)
        sub = f"{path}.{info.alias or name}" if path else (info.alias or name)
        if isinstance(value, BaseModel):
            yield from walk(value, sub)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from walk(item, f"{sub}[{i}]")


def _dig(wire: Any, dotted: str) -> Any:
    for key in dotted.split(".") if dotted else []:
        if not isinstance(wire, dict) or key not in wire:
            return None
        wire = wire[key]
    return wire


def check_rules(obj: BaseModel, path: str = "", old_obj: BaseModel | None = None) -> list[Problem]:
    """Evaluate the rules on every model inside obj (its wire path prefixed by `path`).

    Without old_obj: the rules that hold for any object (what creating it checks). With old_obj:
    only the transition rules, comparing each model with the one at the same path in old_obj (what
    an update checks in addition).
    """
    olds = dict(walk(old_obj, path)) if old_obj is not None else {}
    problems: list[Problem] = []
    for where, node in walk(obj, path):
        rules = [r for r in rules_for(type(node)) if r.transition == (old_obj is not None)]
        before = olds.get(where)
        if not rules or (old_obj is not None and before is None):
            continue
        wire = node.model_dump(mode="json", by_alias=True, exclude_none=True)
        env: dict[str, Any] = {"self": wire}
        if before is not None:
            env["oldSelf"] = before.model_dump(mode="json", by_alias=True, exclude_none=True)
        for rule in rules:
            if not rule.expr.evaluate(env):
                blamed = ".".join(p for p in (where, rule.field) if p)
                problems.append(Problem(blamed, _dig(wire, rule.field), rule.message))
    return problems
