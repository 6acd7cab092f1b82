"""SPMD over a trainer group: rank 0 leads, the other ranks mirror every backend call, data parallel.

Why it exists: a TrainBackend call is collective, but the trainer's commands run code with
data-dependent control flow on rank 0 (the pre-flight only probes when the checksums match; a
transport may stop reading the export early). So rank 0 wraps its backend in `LeaderBackend`: each
call is first announced to the other ranks (one broadcast on a gloo control group), then every rank
runs it, and the FSDP collectives line up by construction; ranks > 0 sit in `follow()`. Data
parallel: every rank takes its slice of the batch's rows (`shard_rows`, padded with rows that train
nothing), logprobs are all-gathered back to [B, T-1], loss metrics averaged by trained tokens.
docs/trainer.md ("How every rank runs a command") has the details.

Who calls it: lockstep.trainer.server (rank 0: LeaderBackend; ranks > 0: follow).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lockstep.train.backend import StepResult

if TYPE_CHECKING:
    import torch

    from lockstep.train.backend import TrainBackend
    from lockstep.train.common.batch import TrainBatch
    from lockstep.train.common.losses import LossFn

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = dt.timedelta(days=7)
"""How long ranks > 0 wait for the next call: the driver may take long between commands (rollout),
so the control group must not time out like a training collective would."""


def control_group() -> Any:
    """A gloo group over all ranks for the control broadcasts (collective: every rank calls it once)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def shard_rows(batch: TrainBatch, rank: int, world_size: int) -> TrainBatch:
    """This rank's contiguous slice of rows, padded to ceil(B / world_size) rows that train nothing."""
    import torch

    per = -(-batch.size // world_size)
    start = min(rank * per, batch.size)
    part = batch.rows(start, min(start + per, batch.size))
    missing = per - part.size
    if missing == 0:
        return part
    filler = batch.rows(0, 1)

    def cat(a: torch.Tensor | None, b: torch.Tensor | None, zero: bool = False) -> torch.Tensor | None:
        if a is None or b is None:
            return None
        pad = (torch.zeros_like(b) if zero else b).expand(missing, *b.shape[1:])
        return torch.cat([a, pad])

    def cat_t(a: torch.Tensor, b: torch.Tensor, zero: bool = False) -> torch.Tensor:
        out = cat(a, b, zero)
        assert out is not None
        return out

    return replace(
        part,
        input_ids=cat_t(part.input_ids, filler.input_ids),
        attention_mask=cat_t(part.attention_mask, filler.attention_mask),
        loss_mask=cat_t(part.loss_mask, filler.loss_mask, zero=True),  # padding rows train nothing
        rollout_logprobs=cat_t(part.rollout_logprobs, filler.rollout_logprobs),
        advantages=cat_t(part.advantages, filler.advantages, zero=True),
        old_logprobs=cat(part.old_logprobs, filler.old_logprobs),
        ref_logprobs=cat(part.ref_logprobs, filler.ref_logprobs),
        rewards=cat(part.rewards, filler.rewards, zero=True),
        routed_experts=[*part.routed_experts, *filler.routed_experts * missing]
        if filler.routed_experts
        else part.routed_experts,
    )


def dp_logprobs(
    backend: TrainBackend, group: Any, batch: TrainBatch, role: Literal["actor", "ref"]
) -> torch.Tensor:
    """[B, T-1] logprobs of the whole batch: each rank scores its slice, then all-gather (collective)."""
    import torch
    import torch.distributed as dist

    local = backend.compute_logprobs(shard_rows(batch, backend.rank, backend.world_size), role).cpu()
    parts = [torch.empty_like(local) for _ in range(backend.world_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)[: batch.size]


def dp_train_step(backend: TrainBackend, group: Any, batch: TrainBatch, loss_fn: LossFn) -> StepResult:
    """One optimizer step with each rank on its slice; loss metrics averaged by trained tokens (collective)."""
    import torch.distributed as dist

    local = shard_rows(batch, backend.rank, backend.world_size)
    result = backend.train_step(local, loss_fn)
    mine = (result.metrics, local.num_tokens)
    everyone: list[Any] = [None] * backend.world_size
    dist.all_gather_object(everyone, mine, group=group)
    total = sum(n for _, n in everyone) or 1
    keys = sorted({k for m, _ in everyone for k in m})
    metrics = {k: sum(m.get(k, 0.0) * n for m, n in everyone) / total for k in keys}
    return replace(result, metrics=metrics)


def _run(backend: TrainBackend, group: Any, call: tuple[Any, ...]) -> Any:
    """Execute one mirrored call on this rank (the same code on every rank)."""
    name, *args = call
    if name == "logprobs":
        return dp_logprobs(backend, group, *args)
    if name == "train_step":
        return dp_train_step(backend, group, *args)
    if name == "set_learning_rate":
        return backend.set_learning_rate(*args)
    if name == "save":
        return backend.save(*args)  # ends in a barrier: every rank's files are written before a rename
    if name == "load":
        return backend.load(*args)
    if name == "set_reference":
        return backend.set_reference(*args)
    if name == "offload":
        return backend.offload()
    if name == "onload":
        return backend.onload()
    raise ValueError(f"unknown mirrored call {name!r}")


def follow(backend: TrainBackend, group: Any) -> str:
    """Ranks > 0: run every call rank 0 announces, until it announces "exit"; returns why rank 0
    ended the group (lockstep.trainer.server.Ending: `shutdown`, the driver's, when the job is done)."""
    import torch.distributed as dist

    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        call = box[0]
        if call[0] == "exit":
            return str(call[1]) if len(call) > 1 else "shutdown"
        if call[0] == "export":
            for _ in backend.export_weights():  # the gathers are collective; rank 0 updates the tensors
                pass
            continue
        if call[0] == "export_base":
            for _ in backend.export_base():
                pass
            continue
        _run(backend, group, call)


class LeaderBackend:
    """Rank 0's TrainBackend: announces each call to the followers, then runs it like they do."""

    def __init__(self, backend: TrainBackend, group: Any) -> None:
        self.inner = backend
        """The rank's own FSDP backend."""
        self.group = group
        """The gloo control group (control_group())."""

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def step(self) -> int:
        return self.inner.step

    @property
    def device_type(self) -> str:
        return str(getattr(self.inner, "device_type", "cpu"))

    def _announce(self, *call: Any) -> None:
        import torch.distributed as dist

        if self.world_size > 1:
            dist.broadcast_object_list([call], src=0, group=self.group)

    def _mirror(self, *call: Any) -> Any:
        self._announce(*call)
        return _run(self.inner, self.group, call)

    def compute_logprobs(self, batch: TrainBatch, role: Literal["actor", "ref"] = "actor") -> torch.Tensor:
        result: torch.Tensor = self._mirror("logprobs", batch, role)
        return result

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> StepResult:
        result: StepResult = self._mirror("train_step", batch, loss_fn)
        return result

    def set_learning_rate(self, lr: float) -> None:
        self._mirror("set_learning_rate", lr)

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full tensors; a consumer that stops early still completes every rank's gathers."""
        self._announce("export")
        it = self.inner.export_weights()
        try:
            yield from it
        finally:
            for _ in it:  # the followers gather every tensor; so must rank 0, or they would hang
                pass

    def export_base(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: the frozen base's full tensors (the pre-flight's base checksums); collective like
        export_weights, so the followers' gathers complete even when the consumer stops early."""
        self._announce("export_base")
        it = self.inner.export_base()
        try:
            yield from it
        finally:
            for _ in it:
                pass

    def save(self, directory: Path, extra: dict[str, Any] | None = None) -> None:
        self._mirror("save", Path(directory), extra)

    def load(self, directory: Path) -> dict[str, Any]:
        extra: dict[str, Any] = self._mirror("load", Path(directory))
        return extra

    def set_reference(self, directory: Path) -> None:
        self._mirror("set_reference", Path(directory))

    def offload(self) -> None:
        self._mirror("offload")

    def onload(self) -> None:
        self._mirror("onload")

    def release_followers(self, why: str = "shutdown") -> None:
        """Tell ranks > 0 to leave `follow()`, and why (lockstep.trainer.server.Ending)."""
        self._announce("exit", why)

    def close(self) -> None:
        self.inner.close()
