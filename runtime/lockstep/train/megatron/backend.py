"""MegatronBackend: a TrainBackend on megatron-core's GPTModel with TP/PP/EP and the distributed optimizer.

Why it exists: see lockstep.train.backend for the contract, §7.1 and §9 for why Megatron. Per rank:
the model of its pipeline stage (lockstep.train.megatron.model) in bf16, wrapped in megatron-core's
DistributedDataParallel (fp32 gradient buffers) and its distributed optimizer (fp32 master weights and
Adam moments sharded over data-parallel ranks; torch's AdamW underneath, so the update is the FSDP
backend's). Forward and backward go through megatron-core's schedules (`get_forward_backward_func`),
which run the pipeline and finalise gradients.

Batches: the SPMD layer (lockstep.trainer.spmd) hands every rank a contiguous slice of rows, as for
FSDP, but TP/PP peers must see the same rows. So the backend first reassembles the whole batch (one
all-gather of the slices), trains its data-parallel rank's rows, and hands back the rows of its own
slice: logprobs are all-gathered over data parallel (and sent from the last pipeline stage), losses
and metrics are summed over data parallel, so every rank returns the global numbers.

The same numbers as FSDP: logprobs of exactly the batch's token IDs with the engine's temperature
definition (lockstep.train.common.logprobs; split over the vocabulary under TP), the loss is a
`LossFn` from lockstep.train.common.losses summed per token and divided by the batch's trained tokens,
gradients are clipped on their global norm, and a non-finite loss or norm skips the update. R3
replays the rollout's experts through megatron-core's router replay (lockstep.train.megatron.r3).

Memory (§7.1): `offload()` moves the weights and the optimizer state to host memory or local disk
and frees the gradient buffers; any later call brings them back first. With
`stream_optimizer_state` the Adam moments live on local disk and are streamed through the GPU bucket
by bucket inside the optimizer step (lockstep.train.megatron.state).

Who calls it: lockstep.train.factory (from the RLJob: trainer.backend megatron), tests, bench/.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lockstep.models.checkpoint import copy_model_files
from lockstep.train.backend import StepResult
from lockstep.train.common.logprobs import token_logprobs
from lockstep.train.common.r3 import ReplayPlan, RoutingRecord, build_replay
from lockstep.train.megatron import checkpoint as ckpt
from lockstep.train.megatron.config import ExpertLayout, MegatronConfig, ModelShape
from lockstep.train.megatron.export import MegatronExport
from lockstep.train.megatron.model import build_gpt, load_into, local_weights
from lockstep.train.megatron.parallel import Groups, destroy_parallel, init_parallel
from lockstep.train.megatron.r3 import RouterReplayHooks, routers
from lockstep.train.megatron.state import Stash, StreamedOptimizerState, inner_optimizers, optimizer_tensors

if TYPE_CHECKING:
    import torch

    from lockstep.train.common.batch import TrainBatch
    from lockstep.train.common.losses import LossFn


@dataclass(slots=True)
class _Micro:
    """One micro-batch on the device, with its R3 plan."""

    batch: TrainBatch
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    plan: ReplayPlan | None


class MegatronBackend:
    """The Megatron TrainBackend (see module doc). Construct on every rank."""

    def __init__(self, config: MegatronConfig) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "trainer.backend megatron needs CUDA (megatron-core's rotary embedding and fused paths do "
                "not run on the CPU): set trainer.device to cuda on a GPU node, or trainer.backend to fsdp"
            )
        self.config = config
        self.shape = ModelShape.from_checkpoint(config.checkpoint())
        self.groups: Groups = init_parallel(config.parallelism, "cuda", config.seed)
        self.rank, self.world_size = self.groups.dist.rank, self.groups.dist.world_size
        config.parallelism.check(self.shape, self.world_size)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.device_type = "cuda"
        self.step = 0
        torch.manual_seed(config.seed + self.rank)
        self._tmp = (
            tempfile.TemporaryDirectory(prefix="lockstep-megatron-") if config.state_dir is None else None
        )
        self.state_dir = Path(config.state_dir or self._tmp.name) / f"rank{self.rank}"  # type: ignore[union-attr]
        self.bare, self.model = self._build_actor()
        self.optimizer = self._build_optimizer()
        self.ref_bare: Any = None
        self.ref_model: Any = None
        if config.with_ref:
            self.ref_bare, self.ref_model = self._build_ref()
        self.hooks = self._hooks(self.bare)
        self.ref_hooks = self._hooks(self.ref_bare) if self.ref_bare is not None else None
        self.streamed = self._streaming()
        self.stash = Stash(
            "disk" if config.offload == "disk" else "cpu",
            self.state_dir / "offload" if config.offload == "disk" else None,
        )
        self.offloaded = False
        """True between offload() and the next call that needs the device state."""
        self.routing_dims = (self.shape.num_layers, self.shape.top_k, self.shape.num_experts)
        self.last_routing = RoutingRecord()
        """R3 counts of the last compute_logprobs or train_step on this rank."""

    # -- construction ---------------------------------------------------------------------------

    def _bf16(self) -> bool:
        return self.config.dtype == "bfloat16"

    def _build_bare(self, path: Path | None = None) -> Any:
        """The bare model with this rank's shard of the weights at `path` (default: the configured checkpoint)."""
        bare = build_gpt(self.shape, self.config.parallelism, self.groups.spec, bf16=self._bf16(), cuda=True)
        source = self.config.checkpoint() if path is None else Path(path)
        load_into(bare, local_weights(self.shape, source, self.groups.spec, seed=self.config.seed))
        return bare

    def _build_actor(self) -> tuple[Any, Any]:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.transformer.module import Float16Module

        bare = self._build_bare()
        wrapped = Float16Module(bare.config, bare) if self._bf16() else bare
        ddp = DistributedDataParallel(
            config=bare.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=False
            ),
            module=wrapped,
        )
        bare.config.no_sync_func = ddp.no_sync
        bare.config.finalize_model_grads_func = finalize_model_grads
        return bare, ddp

    def _build_optimizer(self) -> Any:
        import torch
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        c = self.config
        oc = OptimizerConfig(
            optimizer="adam",
            lr=c.lr,
            weight_decay=c.weight_decay,
            adam_beta1=c.betas[0],
            adam_beta2=c.betas[1],
            adam_eps=1e-8,
            bf16=self._bf16(),
            params_dtype=torch.bfloat16 if self._bf16() else torch.float32,
            use_distributed_optimizer=True,
            clip_grad=c.grad_clip,
        )
        return get_megatron_optimizer(oc, [self.model], use_gloo_process_groups=False)

    def _build_ref(self, path: Path | None = None) -> tuple[Any, Any]:
        from megatron.core.transformer.module import Float16Module

        bare = self._build_bare(path)
        bare.requires_grad_(False)
        model = Float16Module(bare.config, bare) if self._bf16() else bare
        model.eval()
        return bare, model

    def _hooks(self, bare: Any) -> RouterReplayHooks | None:
        if not self.shape.is_moe:
            return None
        hooks = RouterReplayHooks(replay=self.config.r3_replay)
        hooks.install(bare)
        return hooks

    def _streaming(self) -> StreamedOptimizerState | None:
        if not self.config.stream_optimizer_state:
            return None
        streamed = StreamedOptimizerState(self.state_dir / "optimizer", self.config.optimizer_bucket_bytes)
        streamed.install(self.optimizer)
        return streamed

    # -- batches ----------------------------------------------------------------------------------

    def _whole(self, batch: TrainBatch) -> tuple[TrainBatch, int]:
        """The batch of every rank's slice, in rank order, and where this rank's slice starts."""
        import torch.distributed as dist

        if self.world_size == 1:
            return batch, 0
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, batch)
        return _concat(parts), self.rank * batch.size

    def _dp_rows(self, whole: TrainBatch) -> TrainBatch:
        """This data-parallel rank's contiguous rows, padded so every rank runs as many micro-batches."""
        dp, r = self.groups.dp_size, self.groups.dp_rank
        per = -(-whole.size // dp)
        start = min(r * per, whole.size)
        mine = whole.rows(start, min(start + per, whole.size))
        if mine.size == 0:
            mine = whole.rows(0, 1).padded(1)
            mine = replace(
                mine, loss_mask=mine.loss_mask * 0, advantages=mine.advantages * 0, routed_experts=[None]
            )
        return mine.padded(per)

    def _micro_batches(self, rows: TrainBatch) -> tuple[list[_Micro], int]:
        """Equal-sized micro-batches on the device (pipeline stages exchange fixed shapes)."""
        import torch

        mbs = min(self.config.micro_batch_size, rows.size)
        count = -(-rows.size // mbs)
        rows = rows.padded(count * mbs)
        layers, top_k, experts = self.routing_dims
        out = []
        for i in range(count):
            mb = _to_device(rows.rows(i * mbs, (i + 1) * mbs), self.device)
            plan = build_replay(
                mb.routed_experts,
                mb.attention_mask,
                num_layers=layers,
                top_k=top_k,
                num_experts=experts,
                row_offset=i * mbs,
            )
            ids = mb.input_ids
            pos = torch.arange(ids.shape[1], device=self.device).unsqueeze(0).expand_as(ids)
            out.append(_Micro(mb, ids, pos, plan))
        return out, mbs

    # -- forward / backward -----------------------------------------------------------------------

    def _logprobs(self, logits: torch.Tensor, mb: _Micro) -> torch.Tensor:
        """[b, T-1] float32 logprobs of the micro-batch's own tokens (vocab-parallel under TP)."""
        if self.groups.spec.tp_size == 1:
            return token_logprobs(logits, mb.input_ids, mb.batch.temperature)
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        if mb.batch.temperature <= 0:
            raise ValueError(f"temperature must be > 0 to define logprobs, got {mb.batch.temperature}")
        scaled = logits[:, :-1].float() / mb.batch.temperature
        out: torch.Tensor = -vocab_parallel_cross_entropy(scaled.contiguous(), mb.input_ids[:, 1:])
        return out

    def _run(
        self,
        model: Any,
        hooks: RouterReplayHooks | None,
        micros: list[_Micro],
        mbs: int,
        loss: Callable[[_Micro, torch.Tensor], Any],
        forward_only: bool,
    ) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data: Iterator[_Micro], m: Any) -> tuple[Any, Any]:
            mb = next(data)
            if hooks is not None:
                hooks.plan = mb.plan
            out = m(mb.input_ids, mb.position_ids, None)
            return out, partial(_loss_adapter, loss, mb)

        record = RoutingRecord()
        if hooks is not None:
            hooks.record = record
        result: list[Any] = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micros),
            model=[model],
            num_microbatches=len(micros),
            seq_length=int(micros[0].input_ids.shape[1]),
            micro_batch_size=mbs,
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )
        if hooks is not None:
            hooks.plan = None
        self.last_routing = record
        return result

    def _from_last_stage(self, value: Any) -> Any:
        """`value` of the last pipeline stage, on every stage (a Python object: small)."""
        import torch.distributed as dist

        if self.groups.spec.pp_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(
            box, src=self.groups.pp_global_rank(self.groups.spec.pp_size - 1), group=self.groups.pp
        )
        return box[0]

    # -- the protocol -----------------------------------------------------------------------------

    def set_reference(self, directory: Path) -> None:
        import torch

        if self.ref_model is None:
            raise ValueError("set_reference needs MegatronConfig.with_ref=True (the manifest's kl_coef > 0)")
        self.onload()  # the stash holds the old reference's tensors under their names
        if self.ref_hooks is not None:
            self.ref_hooks.remove()
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
            self.ref_bare, self.ref_model = self._build_ref(Path(directory))
        self.ref_hooks = self._hooks(self.ref_bare)

    def compute_logprobs(self, batch: TrainBatch, role: Literal["actor", "ref"] = "actor") -> torch.Tensor:
        import torch
        import torch.distributed as dist

        if role == "ref" and self.ref_model is None:
            raise ValueError("role='ref' needs MegatronConfig.with_ref=True (the manifest's kl_coef > 0)")
        self.onload()
        whole, offset = self._whole(batch)
        rows = self._dp_rows(whole)
        micros, mbs = self._micro_batches(rows)
        model, hooks = (self.model, self.hooks) if role == "actor" else (self.ref_model, self.ref_hooks)
        model.eval()
        with torch.no_grad():
            parts = self._run(
                model, hooks, micros, mbs, lambda mb, out: self._logprobs(out, mb).float(), True
            )
        local = torch.cat(parts)[: rows.size].cpu() if parts else None
        local = self._from_last_stage(local)
        if self.groups.dp_size > 1:
            gathered: list[Any] = [None] * self.groups.dp_size
            dist.all_gather_object(gathered, local, group=self.groups.dp)
            local = torch.cat(gathered)
        assert local is not None
        return local[offset : offset + batch.size] * batch.loss_mask

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> StepResult:
        self.onload()
        whole, _ = self._whole(batch)
        total = whole.num_tokens
        rows = self._dp_rows(whole)
        micros, mbs = self._micro_batches(rows)
        scale = self.groups.dp_size * len(micros) / max(total, 1)
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outs = self._run(
            self.model, self.hooks, micros, mbs, partial(_policy_loss, self, loss_fn, scale), False
        )
        loss_sum, metrics = self._reduce(outs)
        mean_loss = loss_sum / max(total, 1)
        grad_norm, skipped = self._update(mean_loss)
        metrics.update(self._r3_metrics(whole))
        return StepResult(loss=mean_loss, grad_norm=grad_norm, tokens=total, metrics=metrics, skipped=skipped)

    def _reduce(self, outs: list[dict[str, Any]]) -> tuple[float, dict[str, float]]:
        """Loss sum and token-weighted metrics over micro-batches and data parallel (on every rank)."""
        import torch
        import torch.distributed as dist

        summary = None
        if self.groups.last_stage:
            keys = sorted({k for o in outs for k in o["metrics"]})
            vec = [sum(float(o["loss_sum"]) for o in outs), sum(o["tokens"] for o in outs)]
            vec += [sum(o["metrics"].get(k, 0.0) * o["tokens"] for o in outs) for k in keys]
            t = torch.tensor(vec, dtype=torch.float64, device=self.device)
            if self.groups.dp_size > 1:
                dist.all_reduce(t, group=self.groups.dp)
            values = t.tolist()
            tokens = max(values[1], 1.0)
            summary = (values[0], {k: v / tokens for k, v in zip(keys, values[2:], strict=True)})
        return self._from_last_stage(summary)  # type: ignore[no-any-return]

    def _update(self, mean_loss: float) -> tuple[float, bool]:
        """Clip and apply the update unless the loss or the global gradient norm is not finite."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        skipped = not (math.isfinite(mean_loss) and math.isfinite(norm))
        if not skipped:
            if self.config.grad_clip > 0:
                for part in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
                    params = part.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(params, max_norm=self.config.grad_clip, total_norm=norm)
            self.optimizer.step_with_ready_grads()
            self.step += 1
        self.optimizer.zero_grad()
        return norm, skipped

    def _r3_metrics(self, whole: TrainBatch) -> dict[str, float]:
        """r3_routing_mismatch (all stages and data-parallel ranks) and r3_payload_bytes of the batch."""
        import torch
        import torch.distributed as dist

        if not self.shape.is_moe:
            return {}
        counts = torch.tensor([0.0, 0.0], dtype=torch.float64, device=self.device)
        if self.groups.spec.tp_rank == 0:  # TP peers count the same tokens
            counts += torch.tensor(
                [self.last_routing.pairs, self.last_routing.mismatched],
                dtype=torch.float64,
                device=self.device,
            )
        if self.world_size > 1:
            dist.all_reduce(counts)
        pairs, mismatched = counts.tolist()
        if pairs == 0:
            return {}
        nbytes = sum(len(p) for p in whole.routed_experts if p is not None)
        return {"r3_routing_mismatch": mismatched / pairs, "r3_payload_bytes": float(nbytes)}

    def set_learning_rate(self, lr: float) -> None:
        if not lr > 0:
            raise ValueError(f"learning rate must be > 0, got {lr}")
        for inner in inner_optimizers(self.optimizer):
            for group in inner.param_groups:
                group["lr"] = lr

    # -- weights, checkpoints, memory -------------------------------------------------------------

    def export_base(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA's frozen base: LoRA is not built on this backend (refused at apply, lora-needs-fsdp)."""
        raise ValueError("export_base: LoRA trains on the fsdp backend only (spec.trainer.backend: fsdp)")

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors in HF names (rank 0's are the update; every rank must iterate to the end)."""
        import torch

        self.onload()
        export = MegatronExport(
            self.bare,
            self.shape,
            self.groups,
            ExpertLayout(self.config.expert_layout),
            self.config.export_bucket_bytes,
        )
        with torch.no_grad():
            yield from export

    def save(self, directory: Path, extra: dict[str, Any] | None = None) -> None:
        self.onload()
        ckpt.save(self, Path(directory), extra or {})
        if self.rank == 0:  # tokenizer and generation config: the saved dir loads alone in transformers
            copy_model_files(self.config.checkpoint(), directory)

    def load(self, directory: Path) -> dict[str, Any]:
        self.onload()
        return ckpt.load(self, Path(directory))

    def _device_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every device tensor offload moves: param buffers, master weights, resident moments, ref weights."""
        for i, buf in enumerate(list(self.model.buffers) + list(self.model.expert_parallel_buffers)):
            if buf.param_data is not None:
                yield f"param.{i}", buf.param_data
        for key, t in optimizer_tensors(self.optimizer, moments=self.streamed is None):
            yield f"opt.{key}", t
        if self.ref_bare is not None:
            for name, p in self.ref_bare.named_parameters():
                yield f"ref.{name}", p.data

    def offload(self) -> None:
        """Weights and optimizer state to host memory or disk (trainer.offload), gradient buffers freed."""
        import torch

        if self.offloaded:
            return
        torch.cuda.synchronize()
        for key, t in self._device_state():
            self.stash.put(key, t)
        self.model.offload_grad_buffers()
        self.offloaded = True
        torch.cuda.empty_cache()

    def onload(self) -> None:
        """Undo `offload` (no-op when nothing is offloaded)."""
        import torch

        if not self.offloaded:
            return
        for key, t in self._device_state():
            self.stash.take(key, t)
        self.model.restore_grad_buffers()
        torch.cuda.synchronize()
        self.offloaded = False

    def close(self) -> None:
        """Remove hooks, forget this model's router-replay instances, release the process groups."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        for hooks in (self.hooks, self.ref_hooks):
            if hooks is not None:
                hooks.remove()
        mine = {
            id(r.router_replay)
            for bare in (self.bare, self.ref_bare)
            if bare is not None
            for r in routers(bare)
        }
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine
        ]
        for bare in (self.bare, self.ref_bare):
            if bare is not None:  # config -> no_sync -> DDP -> config: break the cycle, free memory now
                bare.config.no_sync_func = None
                bare.config.finalize_model_grads_func = None
        self.bare = self.model = self.optimizer = self.ref_bare = self.ref_model = None
        destroy_parallel(self.groups)
        if self._tmp is not None:
            self._tmp.cleanup()
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def _loss_adapter(
    loss: Callable[[_Micro, Any], Any], mb: _Micro, output: Any, non_loss_data: bool = False
) -> Any:
    """megatron-core calls loss_func(output) (training) or loss_func(output, non_loss_data=True) (scoring)."""
    return loss(mb, output)


def _policy_loss(backend: MegatronBackend, loss_fn: LossFn, scale: float, mb: _Micro, logits: Any) -> Any:
    """The training loss of one micro-batch: the LossFn per token, summed and scaled to a token mean.

    megatron-core divides by the number of micro-batches and averages gradients over data parallel,
    so `scale` (dp x micro-batches / the batch's trained tokens) makes the gradient that of the sum of
    every token's loss divided by the batch's trained tokens, as in FSDP.
    """
    per_token, metrics = loss_fn(backend._logprobs(logits, mb), mb.batch)
    total = per_token.sum()
    return total * scale, {"loss_sum": total.detach(), "tokens": mb.batch.num_tokens, "metrics": metrics}


def _concat(parts: list[TrainBatch]) -> TrainBatch:
    """Row-wise concatenation of equally shaped batches (the SPMD slices of every rank)."""
    import torch

    first = parts[0]

    def cat(name: str) -> Any:
        values = [getattr(p, name) for p in parts]
        return None if any(v is None for v in values) else torch.cat(values)

    return replace(
        first,
        input_ids=cat("input_ids"),
        attention_mask=cat("attention_mask"),
        loss_mask=cat("loss_mask"),
        rollout_logprobs=cat("rollout_logprobs"),
        advantages=cat("advantages"),
        old_logprobs=cat("old_logprobs"),
        ref_logprobs=cat("ref_logprobs"),
        rewards=cat("rewards"),
        routed_experts=[r for p in parts for r in (p.routed_experts or [None] * p.size)],
    )


def _to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    def mv(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(device)

    return replace(
        batch,
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        loss_mask=batch.loss_mask.to(device),
        rollout_logprobs=batch.rollout_logprobs.to(device),
        advantages=batch.advantages.to(device),
        old_logprobs=mv(batch.old_logprobs),
        ref_logprobs=mv(batch.ref_logprobs),
    )
