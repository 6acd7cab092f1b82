"""What a Megatron model is made of, read from an HF checkpoint's config.json (pure, no megatron import).

Why it exists: the user brings an HF checkpoint; megatron-core wants a `TransformerConfig` and a layer
spec. `ModelShape.from_hf` reads the HF config (transformers' AutoConfig, so every spelling transformers
accepts is read the same way) into the few numbers both sides share, refusing what the Megatron local
layer spec cannot express with a message naming the config field. `transformer_config_kwargs` maps a
shape plus a `ParallelLayout` onto TransformerConfig's keyword arguments; tests check the mapping on CPU
without building a model.

Supported: Qwen3 dense (`Qwen3ForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`): RMSNorm, q/k RMSNorm
per head (qk-layernorm), grouped-query attention, RoPE with the checkpoint's theta, SwiGLU MLPs, tied
or untied embeddings, MoE routers with softmax top-k (norm_topk_prob true: softmax over the chosen
k logits, megatron's `moe_router_pre_softmax=False`; false: softmax over all experts first, then
top-k, `moe_router_pre_softmax=True`), dense layers inside a MoE model (`mlp_only_layers`,
`decoder_sparse_step`).

Who calls it: lockstep.train.megatron.model (building the GPTModel), .convert (tensor shapes), tests.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockstep.train.backend import BackendConfig

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
"""HF architectures the Megatron backend builds (config.json `architectures[0]`)."""


class UnsupportedModel(ValueError):
    """The checkpoint's config.json describes something the Megatron backend cannot build."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The architecture numbers shared by the HF and the Megatron model (one per checkpoint)."""

    architecture: str
    """HF architecture name (one of SUPPORTED_ARCHITECTURES)."""
    num_layers: int
    """Decoder layers (HF num_hidden_layers)."""
    hidden_size: int
    """Model width H."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (query groups of GQA)."""
    head_dim: int
    """Width of one head (HF head_dim; Megatron kv_channels)."""
    ffn_hidden_size: int
    """Width of a dense MLP (HF intermediate_size)."""
    vocab_size: int
    """Rows of the embedding and the output layer."""
    rms_eps: float
    """RMSNorm epsilon."""
    rope_theta: float
    """RoPE base."""
    tie_embeddings: bool
    """The output layer shares the embedding's weight (no lm_head tensor in the checkpoint)."""
    max_positions: int
    """Longest sequence the RoPE table is built for."""
    init_std: float = 0.02
    """HF initializer_range (random init of a checkpoint without weights)."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: dense model)."""
    top_k: int = 0
    """Experts per token."""
    moe_ffn_hidden_size: int = 0
    """Width of one expert's MLP (HF moe_intermediate_size)."""
    norm_topk_prob: bool = True
    """Gate values renormalised over the chosen top-k."""
    moe_layers: tuple[bool, ...] = ()
    """Per layer: True where the MLP is a sparse MoE block (empty for a dense model)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_per_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, config: Any) -> ModelShape:
        """Read a transformers config object; raises UnsupportedModel naming the field and the fix."""
        arch = (list(getattr(config, "architectures", None) or []) or [""])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"config.json architectures: {arch or '(none)'} is not built by the megatron backend "
                f"(it builds {', '.join(SUPPORTED_ARCHITECTURES)}); use trainer.backend fsdp for this model"
            )
        _refuse_unsupported(config)
        num_layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
        experts = int(getattr(config, "num_experts", 0) or 0) if arch == "Qwen3MoeForCausalLM" else 0
        shape = cls(
            architecture=arch,
            num_layers=num_layers,
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            ffn_hidden_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            rms_eps=float(config.rms_norm_eps),
            rope_theta=rope_theta(config),
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_positions=int(getattr(config, "max_position_embeddings", 4096)),
            init_std=float(getattr(config, "initializer_range", 0.02)),
            num_experts=experts,
            top_k=int(config.num_experts_per_tok) if experts else 0,
            moe_ffn_hidden_size=int(config.moe_intermediate_size) if experts else 0,
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
            moe_layers=_moe_layers(config, num_layers) if experts else (),
        )
        if heads % kv:
            raise UnsupportedModel(
                f"config.json num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
            )
        return shape

    @classmethod
    def from_checkpoint(cls, path: Path) -> ModelShape:
        """`from_hf` of the config.json in an HF checkpoint directory."""
        from transformers import AutoConfig

        return cls.from_hf(AutoConfig.from_pretrained(Path(path)))


def rope_theta(config: Any) -> float:
    """The RoPE base: transformers >= 5 keeps it in rope_parameters, older configs in rope_theta."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(config, "rope_theta", 10000.0))


def _refuse_unsupported(config: Any) -> None:
    """Features of the HF config that the local layer spec would silently compute differently."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    problems = []
    if kind not in ("default", None):
        problems.append(
            f"rope scaling {kind!r} (rope_parameters.rope_type) is not built; use a default-RoPE checkpoint"
        )
    if getattr(config, "use_sliding_window", False):
        problems.append("use_sliding_window is true: sliding-window attention is not built")
    if getattr(config, "attention_bias", False):
        problems.append("attention_bias is true: the local layer spec has no q/k/v/o biases")
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.hidden_act!r}: only silu (SwiGLU) is built")
    if problems:
        raise UnsupportedModel("config.json: " + "; ".join(problems) + " (or use trainer.backend fsdp)")


def _moe_layers(config: Any, num_layers: int) -> tuple[bool, ...]:
    """Qwen3-MoE's rule: layer i is sparse unless listed in mlp_only_layers, every decoder_sparse_step."""
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """Model-parallel sizes of the trainer (trainer.parallelism); data parallel is what remains."""

    tensor: int = 1
    """TP: attention heads, MLP width and the vocabulary split over this many ranks."""
    pipeline: int = 1
    """PP: decoder layers split into this many consecutive stages."""
    context: int = 1
    """CP: not built (the local attention cannot split the sequence); must be 1."""
    expert: int = 1
    """EP: routed experts spread over this many ranks (the same GPUs, not more)."""
    expert_tensor: int = 1
    """ETP: each expert's MLP split over this many ranks."""

    def check(self, shape: ModelShape, world_size: int) -> None:
        """Refuse a layout this model or the local layer spec cannot run, naming trainer.parallelism."""
        where = "trainer.parallelism"
        problems = []
        if world_size % (self.tensor * self.pipeline * self.context):
            problems.append(
                f"tensor x pipeline x context = {self.tensor * self.pipeline * self.context} does not divide {world_size} ranks"
            )
        if (world_size // self.pipeline) % (self.expert * self.expert_tensor):
            problems.append(
                f"expert x expertTensor does not divide the {world_size // self.pipeline} ranks of a stage"
            )
        if self.context > 1:
            problems.append(
                "context > 1: context parallelism needs Transformer Engine's attention, and this backend "
                "runs megatron-core's local layer spec; set context to 1"
            )
        if shape.num_kv_heads % self.tensor:
            problems.append(
                f"tensor {self.tensor} does not divide the model's {shape.num_kv_heads} key/value heads"
            )
        if shape.vocab_size % self.tensor:
            problems.append(f"tensor {self.tensor} does not divide the vocabulary ({shape.vocab_size})")
        if shape.num_layers % self.pipeline:
            problems.append(f"pipeline {self.pipeline} does not divide the model's {shape.num_layers} layers")
        if shape.is_moe and self.tensor > 1:
            problems.append(
                "tensor > 1 on a MoE model needs sequence parallelism, which megatron-core's torch norms "
                "(local layer spec, no Transformer Engine) do not support: shard experts with expert / "
                "expertTensor and keep tensor 1"
            )
        if shape.is_moe and shape.num_experts % self.expert:
            problems.append(f"expert {self.expert} does not divide the model's {shape.num_experts} experts")
        if not shape.is_moe and (self.expert > 1 or self.expert_tensor > 1):
            problems.append("expert / expertTensor > 1 on a dense model: set both to 1")
        if shape.is_moe and shape.moe_ffn_hidden_size % self.expert_tensor:
            problems.append(
                f"expertTensor {self.expert_tensor} does not divide the expert width {shape.moe_ffn_hidden_size}"
            )
        if shape.ffn_hidden_size % self.tensor:
            problems.append(f"tensor {self.tensor} does not divide the MLP width {shape.ffn_hidden_size}")
        if problems:
            raise UnsupportedModel(f"{where}: " + "; ".join(problems))


def transformer_config_kwargs(
    shape: ModelShape, layout: ParallelLayout, *, bf16: bool, cuda: bool
) -> dict[str, Any]:
    """Keyword arguments of megatron-core's TransformerConfig for `shape` under `layout` (pure).

    Every fused kernel is off: they need Apex or Transformer Engine, which the local spec does without.
    The MoE router computes its logits in the model dtype like HF's router, keeps no auxiliary loss
    (RL trains no load balancing, like `output_router_logits=False`), drops no tokens, and has
    megatron-core's routing replay switched on (R3; it only acts when told to replay). Parameters are
    not initialised (the weights always come from the checkpoint, or from an HF random init converted
    like a checkpoint, so both backends start from the same numbers). `cuda` False builds on the CPU
    (tests): the all-to-all MoE dispatcher allocates CUDA streams, the all-gather one does not.
    """
    import torch
    import torch.nn.functional as F

    dtype = torch.bfloat16 if bf16 else torch.float32
    kw: dict[str, Any] = {
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "num_attention_heads": shape.num_heads,
        "num_query_groups": shape.num_kv_heads,
        "kv_channels": shape.head_dim,
        "ffn_hidden_size": shape.ffn_hidden_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": shape.rms_eps,
        "qk_layernorm": True,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "init_method_std": shape.init_std,
        "bf16": bf16,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "attention_softmax_in_fp32": True,
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        "tensor_model_parallel_size": layout.tensor,
        "pipeline_model_parallel_size": layout.pipeline,
        "context_parallel_size": layout.context,
        "expert_model_parallel_size": layout.expert,
        "expert_tensor_parallel_size": layout.expert_tensor,
        "sequence_parallel": False,
        "use_cpu_initialization": not cuda,
        "perform_initialization": False,
    }
    if shape.is_moe:
        kw.update(
            num_moe_experts=shape.num_experts,
            moe_router_topk=shape.top_k,
            moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            moe_router_pre_softmax=not shape.norm_topk_prob,
            moe_layer_freq=[int(m) for m in shape.moe_layers],
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall" if cuda else "allgather",
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_router_fusion=False,
            moe_enable_routing_replay=True,
        )
    return kw


class ExpertLayout(enum.StrEnum):
    """How an HF checkpoint spells routed-expert tensors."""

    PER_EXPERT = "per-expert"
    """The hub's `mlp.experts.<e>.{gate,up,down}_proj.weight`."""
    FUSED = "fused"
    """transformers >= 5: `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronConfig(BackendConfig):
    """Construction-time settings of the Megatron backend (BackendConfig's fields, and these). Weight
    decay is not applied to norms and biases (megatron-core's grouping); a checkpoint without weights
    starts from transformers' random init, converted like a checkpoint."""

    dtype: str = "bfloat16"
    """bfloat16 (weights and compute; fp32 master weights and gradients) or float32."""
    parallelism: ParallelLayout = field(default_factory=ParallelLayout)
    """TP / PP / CP / EP / ETP (trainer.parallelism)."""
    offload: str = "none"
    """Where `offload()` puts weights and optimizer state: none (host memory when asked anyway), cpu
    (pinned host memory) or disk (files under state_dir)."""
    stream_optimizer_state: bool = False
    """Keep the Adam moments on local disk, streamed bucket by bucket in the optimizer step."""
    state_dir: Path | None = None
    """Node-local directory for disk offload and streamed state (default: a temporary directory)."""
    optimizer_bucket_bytes: int = 512 << 20
    """Moment bytes on the GPU at once while streaming."""
    export_bucket_bytes: int = 512 << 20
    """Bucket size of the weight export (spec.weightSync.bucketMiB)."""
    expert_layout: str = ExpertLayout.FUSED.value
    """HF spelling of exported routed experts: fused (transformers' own parameters, what the
    reference engine and the FSDP backend use) or per-expert (the hub's files, stock SGLang)."""

    def __post_init__(self) -> None:
        BackendConfig.__post_init__(self)
        if self.offload not in ("none", "cpu", "disk"):
            raise ValueError(f"offload {self.offload!r} is unknown; use none, cpu or disk")
        ExpertLayout(self.expert_layout)
