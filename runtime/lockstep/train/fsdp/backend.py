"""FSDPBackend: a TrainBackend on an HF causal LM sharded with FSDP2 `fully_shard`.

Why it exists: see lockstep.train.backend for the contract. Each decoder layer and the root module
are wrapped with `fully_shard`, so parameters are DTensors sharded over the ranks; `export_weights`
gathers them to full tensors in HF names (the transformers state-dict names already are HF names).
Logprobs use lockstep.train.common.logprobs, the same definition as the engine's.

R3 (MoE models, §4.1): when a batch carries `routed_experts`, every forward (compute_logprobs
and train_step) runs inside lockstep.train.common.r3.hf_routing, which replays the rollout's expert
IDs in each MoE router (gate values stay the trainer's own scores at those IDs) and measures how
often the trainer's own top-k differed. `FSDPConfig.r3_replay=False` only measures. train_step
reports r3_routing_mismatch and r3_payload_bytes (summed over ranks) in StepResult.metrics.

Who calls it: lockstep.train.factory (local runs through lockstep.driver.policy, and `lockstep trainer`
on rank pods), lockstep.cli.precision.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lockstep.models.checkpoint import copy_model_files
from lockstep.models.loading import load_causal_lm
from lockstep.numerics import exact, sglang_kernels
from lockstep.numerics.recipe import Recipe
from lockstep.train.backend import BackendConfig, StepResult
from lockstep.train.common.dist import init_distributed
from lockstep.train.common.logprobs import sglang_token_logprobs, token_logprobs
from lockstep.train.common.r3 import RoutingRecord, build_replay, hf_routing, routing_dims
from lockstep.train.fsdp import checkpoint as ckpt
from lockstep.train.fsdp import lora, lora_checkpoint, sharded_load
from lockstep.train.fsdp.lora import AdapterConfig
from lockstep.train.fsdp.sharded_load import DEFAULT_BUCKET_BYTES as LOAD_BUCKET_BYTES

if TYPE_CHECKING:
    import torch

    from lockstep.train.common.batch import TrainBatch
    from lockstep.train.common.losses import LossFn


@dataclass(frozen=True, slots=True, kw_only=True)
class FSDPConfig(BackendConfig):
    """Construction-time settings of the FSDP2 backend (BackendConfig's fields, and these)."""

    device: str = "auto"
    """cpu | cuda | auto (cuda when available)."""
    train_recipe: Recipe | None = None
    """Low-precision training forward (spec.trainer.precision, §6 stage 2): the recipe's
    quantized linear layers compute with fake_quantize(weight), gradients straight through."""
    true_on_policy: bool = False
    """Run batch-invariant kernels the rollout engine runs too, so the trainer's logprobs equal the
    rollout's bit for bit (spec.algorithm.trueOnPolicy); which ones: `kernels`."""
    kernels: str = "lockstep"
    """With true_on_policy: `lockstep` (lockstep.numerics.exact, the reference engine's kernels) or
    `sglang` (lockstep.numerics.sglang_kernels: computing as stock SGLang's on-policy path does;
    lockstep.api.profiles.trainer_kernels_for picks it from the rollout engine)."""
    lora: AdapterConfig | None = None
    """spec.model.lora: train a peft LoRA adapter on the frozen base (lockstep.train.fsdp.lora);
    `export_weights` and checkpoints then carry the adapter only. None trains every weight."""
    sharded_load: bool = True
    """Build the model on the meta device and read each rank's own rows of the checkpoint
    (lockstep.train.fsdp.sharded_load); False loads the whole model on every rank first."""
    load_bucket_bytes: int = LOAD_BUCKET_BYTES
    """The staging buffer of a sharded load (host memory per rank: its shards plus this)."""
    offload: str = "none"
    """trainer.offload: `cpu` keeps parameters, gradients and optimizer state in host memory with
    FSDP2's CPUOffloadPolicy (moved to the GPU layer by layer for compute, the optimizer step runs on
    the host); `none` keeps them on the device (offload() then moves only the optimizer state)."""

    def __post_init__(self) -> None:
        BackendConfig.__post_init__(self)
        if self.offload not in ("none", "cpu"):
            raise ValueError(f"offload {self.offload!r}: FSDP offloads to host memory only; use none or cpu")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device {self.device!r} is unknown; use cpu, cuda or auto")
        if self.kernels not in ("lockstep", "sglang"):
            raise ValueError(f"kernels {self.kernels!r} is unknown; use lockstep or sglang")


class FSDPBackend:
    """The FSDP2 TrainBackend (see module doc). Construct on every rank."""

    def __init__(self, config: FSDPConfig) -> None:
        import torch

        self.config = config
        want_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
        self.device_type = "cuda" if want_cuda else "cpu"
        info = init_distributed(self.device_type)
        self._owns_group = info.owns_group
        self.rank, self.world_size = info.rank, info.world_size
        self.device = torch.device("cuda", info.local_rank) if want_cuda else torch.device("cpu")
        if want_cuda:
            torch.cuda.set_device(self.device)
        self.step = 0
        torch.manual_seed(config.seed + self.rank)
        self.model = self._build_model()
        self.optimizer = torch.optim.AdamW(
            self.trainable(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.ref_model = self._build_model(frozen=True) if config.with_ref else None
        self.routing_dims = routing_dims(self.model.config)
        """(layers, top-k, experts) of the model; top-k 0 for a dense model."""
        self.last_routing = RoutingRecord()
        """R3 counts of the last compute_logprobs or train_step on this rank (summed over micro-batches)."""

    def _build_model(self, frozen: bool = False, path: Path | None = None) -> Any:
        """The policy (or, frozen, the reference) from `path` (default: the configured checkpoint)."""
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoConfig, AutoModelForCausalLM

        dtype = torch.bfloat16 if self.config.dtype == "bfloat16" else torch.float32
        path = self.config.checkpoint() if path is None else Path(path)
        model: Any
        # Each rank reads only its shards (sharded_load); a LoRA adapter is built on the loaded base.
        sharded = ckpt.has_weights(path) and self.config.sharded_load and self.config.lora is None
        if sharded:
            model = sharded_load.empty_model(path, dtype)
        elif ckpt.has_weights(path):
            model = load_causal_lm(path, dtype=dtype)
        else:
            torch.manual_seed(self.config.seed)  # every rank builds the same random init
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)  # type: ignore[no-untyped-call]
        if not sharded:
            model.to(self.device)
        if self.config.true_on_policy and self.config.kernels == "sglang":
            sglang_kernels.apply(model, self.device)
        elif self.config.true_on_policy:
            exact.apply(model, self.device)
        if self.config.train_recipe is not None:
            self.config.train_recipe.install_training(model)
        if self.config.lora is not None:
            # The adapter's random init is a function of the seed alone: the same on every rank and
            # world size; the run's RNG stream is left as it was.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.config.seed)
                model = lora.attach(model, self.config.lora, base_path=str(self.config.checkpoint()))
        layers = (lora.hf_model(model) if self.config.lora is not None else model).model.layers
        # An explicit mesh of the trainer's own device type: the default mesh follows the machine (CUDA
        # when present) and would move a CPU trainer's parameters onto the GPU.
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        kwargs: dict[str, Any] = {"mesh": mesh}
        if self.config.offload == "cpu" and self.device_type == "cuda":
            from torch.distributed.fsdp import CPUOffloadPolicy

            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        if sharded:  # with the CPU offload policy the shards live in host memory
            offloaded = "offload_policy" in kwargs
            sharded_load.materialize(model, torch.device("cpu") if offloaded else self.device)
            reader = sharded_load.ShardReader(path, self.config.load_bucket_bytes)
            try:
                sharded_load.load_shards(model, reader)
            finally:
                reader.close()
        if frozen:
            model.requires_grad_(False)
            model.eval()
        return model

    # -- scoring and training -------------------------------------------------------------------

    def _forward_logprobs(self, model: Any, batch: TrainBatch, row_offset: int = 0) -> torch.Tensor:
        ids = batch.input_ids.to(self.device)
        layers, top_k, experts = self.routing_dims
        plan = build_replay(
            batch.routed_experts,
            batch.attention_mask,
            num_layers=layers,
            top_k=top_k,
            num_experts=experts,
            row_offset=row_offset,
        )
        with hf_routing(model, plan, replay=self.config.r3_replay) as record:
            logits = model(
                input_ids=ids, attention_mask=batch.attention_mask.to(self.device)
            ).logits  # [B, T, V]
        if plan is not None:
            self.last_routing.pairs += record.pairs
            self.last_routing.mismatched += record.mismatched
        if sglang_kernels.applied(model):
            return sglang_token_logprobs(logits, ids, batch.temperature)  # [B, T-1]
        return token_logprobs(logits, ids, batch.temperature, exact.tiles_of(model))  # [B, T-1]

    def compute_logprobs(self, batch: TrainBatch, role: Literal["actor", "ref"] = "actor") -> torch.Tensor:
        import torch

        model = self.model if role == "actor" else self.ref_model
        if model is None:
            raise ValueError("role='ref' needs FSDPConfig.with_ref=True (the manifest's kl_coef > 0)")
        mbs = self.config.micro_batch_size
        parts = []
        self.last_routing = RoutingRecord()
        with torch.no_grad():
            for start in range(0, batch.size, mbs):
                parts.append(self._forward_logprobs(model, batch.rows(start, start + mbs), start).cpu())
        return torch.cat(parts) * batch.loss_mask

    def set_reference(self, directory: Path) -> None:
        if self.ref_model is None:
            raise ValueError("set_reference needs FSDPConfig.with_ref=True (the manifest's kl_coef > 0)")
        if self.config.lora is not None:  # the reference is base + the adapter saved there
            lora_checkpoint.load_into(self.ref_model, Path(directory))
            return
        if not ckpt.has_weights(Path(directory)):
            raise FileNotFoundError(f"set_reference: no safetensors weights in {directory}")
        import torch

        # Building a model may draw from the RNG; the run's RNG stream stays as if it had not happened.
        with torch.random.fork_rng(devices=[self.device] if self.device_type == "cuda" else []):
            self.ref_model = self._build_model(frozen=True, path=Path(directory))

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> StepResult:
        import torch
        import torch.distributed as dist

        self.onload()  # a no-op unless offload() ran since the last step
        total = torch.tensor([float(batch.num_tokens)], device=self.device)
        dist.all_reduce(total)
        denom = max(total.item(), 1.0)
        self.model.train()
        loss_sum = 0.0
        sums: dict[str, float] = {}
        mbs = self.config.micro_batch_size
        self.last_routing = RoutingRecord()
        for start in range(0, batch.size, mbs):
            mb = batch.rows(start, start + mbs)
            mb_dev = _to_device(mb, self.device)
            per_token, metrics = loss_fn(self._forward_logprobs(self.model, mb_dev, start), mb_dev)
            # FSDP averages gradients over ranks; scaling by world_size makes the result a global token mean.
            loss = per_token.sum() / denom * self.world_size
            loss.backward()  # type: ignore[no-untyped-call]
            loss_sum += float(per_token.detach().sum().item())
            n = mb.num_tokens
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v * n
        reduced = torch.tensor([loss_sum], device=self.device)
        dist.all_reduce(reduced)
        mean_loss = reduced.item() / denom
        clip = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.trainable(), clip)
        grad_norm = float(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
        skipped = not (math.isfinite(mean_loss) and math.isfinite(grad_norm))
        if not skipped:
            self.optimizer.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        local = max(batch.num_tokens, 1)
        metrics = {k: v / local for k, v in sums.items()}
        metrics.update(self._r3_metrics(batch))
        return StepResult(
            loss=mean_loss,
            grad_norm=grad_norm,
            tokens=int(total.item()),
            metrics=metrics,
            skipped=skipped,
        )

    def _r3_metrics(self, batch: TrainBatch) -> dict[str, float]:
        """r3_routing_mismatch and r3_payload_bytes over all ranks; {} for a dense model or no R3 data.

        Collective on MoE models (every rank calls it, with or without routing data).
        """
        import torch
        import torch.distributed as dist

        if not self.routing_dims[1]:
            return {}
        nbytes = sum(len(p) for p in batch.routed_experts if p is not None)
        counts = torch.tensor(
            [self.last_routing.pairs, self.last_routing.mismatched, nbytes],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(counts)
        pairs, mismatched, total_bytes = counts.tolist()
        if pairs == 0:
            return {}
        return {"r3_routing_mismatch": mismatched / pairs, "r3_payload_bytes": total_bytes}

    def set_learning_rate(self, lr: float) -> None:
        if not lr > 0:
            raise ValueError(f"learning rate must be > 0, got {lr}")
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # -- weights and checkpoints ----------------------------------------------------------------

    def trainable(self) -> list[Any]:
        """The parameters the optimizer steps: all of them, or with LoRA the adapter's only."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def export_base(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: the frozen base's full tensors in HF names (a tied lm_head left out), what the engines
        must serve under the adapter; the pre-flight compares their checksums (collective, like
        export_weights). Raises ValueError without LoRA (export_weights is the whole model then)."""
        if self.config.lora is None:
            raise ValueError(
                "export_base is the frozen base of a LoRA model; without LoRA use export_weights"
            )
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        yield from lora.base_tensors(self.model.state_dict(), tied=tied)

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors in HF names; a tied lm_head is left out, as in HF checkpoints. With LoRA: the
        adapter's tensors only, under peft's saved names (the base never changes)."""
        if self.config.lora is not None:
            yield from lora.adapter_tensors(self.model.state_dict())
            return
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        for name, value in self.model.state_dict().items():
            if tied and name == "lm_head.weight":
                continue
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            yield name, full.detach()

    def adapter_config(self) -> dict[str, Any]:
        """adapter_config.json of the LoRA adapter (peft's, base_model_name_or_path the base checkpoint)."""
        assert self.config.lora is not None
        return lora.adapter_config_dict(self.model, self.config.lora, base_path=str(self.config.checkpoint()))

    def save(self, directory: Path, extra: dict[str, Any] | None = None) -> None:
        if self.config.lora is not None:  # the adapter in peft's layout + its optimizer state
            lora_checkpoint.save(self, Path(directory), extra or {}, self.adapter_config())
            return
        ckpt.save(self, Path(directory), extra or {})
        if self.rank == 0:  # tokenizer and generation config: the saved dir loads alone in transformers
            copy_model_files(self.config.checkpoint(), directory)

    @property
    def load_bucket_bytes(self) -> int:
        """The staging buffer of every sharded read (model load, resume)."""
        return self.config.load_bucket_bytes

    def load(self, directory: Path) -> dict[str, Any]:
        if self.config.lora is not None:
            return lora_checkpoint.load(self, Path(directory))
        return ckpt.load(self, Path(directory))

    def offload(self) -> None:
        """CPU runs keep everything in host memory; on CUDA, free the optimizer's device memory.

        With offload cpu, FSDP2's CPUOffloadPolicy already keeps all state in host memory: a no-op.
        """
        if self.device_type == "cuda" and self.config.offload == "none":
            import torch

            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if hasattr(v, "to") and getattr(v, "is_cuda", False):
                        state[k] = v.to("cpu", non_blocking=True)
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Undo `offload` (Adam's step counters stay on the host, where AdamW keeps them)."""
        if self.device_type == "cuda" and self.config.offload == "none":
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if k != "step" and hasattr(v, "to") and not getattr(v, "is_cuda", True):
                        state[k] = v.to(self.device, non_blocking=True)

    def close(self) -> None:
        import torch.distributed as dist

        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False


def _to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    from dataclasses import replace

    def mv(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(device)

    return replace(
        batch,
        loss_mask=batch.loss_mask.to(device),
        rollout_logprobs=batch.rollout_logprobs.to(device),
        advantages=batch.advantages.to(device),
        old_logprobs=mv(batch.old_logprobs),
        ref_logprobs=mv(batch.ref_logprobs),
    )
