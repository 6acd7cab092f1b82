"""The TrainBackend protocol: what the trainer asks of any backend (FSDP2 or Megatron-core, §8).

Why it exists: the trainer must not care how the policy is sharded. It asks the backend for logprobs
of exact token IDs, one optimizer step with a given loss, the gathered weights in HF names for the
weight transports, checkpoints for resume, and to free device memory between phases. Everything a
future capability needs enters through these calls' arguments, not new methods on the loop:
- MoE with R3 routing replay: `TrainBatch.routed_experts` carries the rollout's expert choices; a
  backend that supports R3 replays them in `compute_logprobs`/`train_step`.
- true-on-policy: a backend profile (deterministic kernels) chosen at construction; the protocol
  is unchanged, the mismatch metrics must then read exactly 0.
- low precision (BF16 train / FP8 serve): `export_weights` yields HF-layout tensors; a quantizing
  step between it and the transport converts them, the backend does not know the serve dtype.
- train offload / optimizer-state streaming: `offload()` / `onload()`.
- SFT / OPD / LoRA: the loss is a parameter (`LossFn`); LoRA changes what `export_weights` yields
  (merged weights or adapters) and what the optimizer holds, not the loop.

Who calls it: lockstep.trainer.local (LocalTrainer: every step, the SFT warm start, weight updates),
through lockstep.trainer.spmd on a trainer group's ranks; lockstep.trainer.state (checkpoints);
`lockstep trainer` without --serve and `lockstep precision-check`. lockstep.train.factory builds one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from lockstep.train.common.batch import TrainBatch
    from lockstep.train.common.losses import LossFn


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendConfig:
    """What every backend is built with: the checkpoint, the optimizer and the batching. FSDPConfig and
    MegatronConfig add their own fields; lockstep.config.trainer builds one from the manifest."""

    model_path: Path | None = None
    """HF checkpoint directory: config.json and, optionally, safetensors weights (absent = random init
    from `seed`). None in a config built from the manifest, before the run's checkpoint is resolved:
    lockstep.train.factory.build_backend(config, model_dir) sets it."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 disables clipping; the norm is still reported)."""
    micro_batch_size: int = 64
    """Rows per forward/backward; gradients accumulate over micro-batches."""
    seed: int = 0
    """Seed of the random init and of the RNG state saved in checkpoints (rank is added)."""
    dtype: str = "float32"
    """Parameter dtype: float32 | bfloat16."""
    with_ref: bool = False
    """Keep a frozen reference policy for `compute_logprobs(role="ref")` (KL): the loaded checkpoint
    until `set_reference`."""
    r3_replay: bool = True
    """When a batch carries R3 routing data (MoE): True replays the rollout's experts; False only
    measures r3_routing_mismatch (what replay would fix)."""
    offload: str = "none"
    """Where `offload()` puts the state between steps (trainer.offload; each backend says what it takes)."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype {self.dtype!r} is not supported; use float32 or bfloat16")

    def checkpoint(self) -> Path:
        """model_path, which a backend needs; a config straight from the manifest has none yet."""
        if self.model_path is None:
            raise ValueError(
                "the backend config has no model_path: build the backend with "
                "lockstep.train.factory.build_backend(config, model_dir)"
            )
        return Path(self.model_path)


@dataclass(slots=True)
class StepResult:
    """What one optimizer step reports."""

    loss: float
    """Token-mean loss over the whole batch (all micro-batches, all ranks)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    tokens: int
    """Trained tokens in the batch."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Loss metrics averaged over micro-batches weighted by their tokens."""
    skipped: bool = False
    """True when the step was not applied (non-finite loss or gradient); weights are unchanged."""


class TrainBackend(Protocol):
    """A sharded policy with its optimizer. All ranks call every method collectively."""

    rank: int
    """This process's rank in the trainer's process group."""
    world_size: int
    """Number of trainer ranks."""
    step: int
    """Optimizer steps applied so far (restored by `load`)."""

    def compute_logprobs(self, batch: TrainBatch, role: Literal["actor", "ref"] = "actor") -> torch.Tensor:
        """[B, T-1] float32 logprobs of the batch's own token IDs, no grad.

        role="actor" uses the current weights; role="ref" the reference policy, for KL: the checkpoint
        as loaded, or the weights `set_reference` loaded since.
        """
        ...

    def set_reference(self, directory: Path) -> None:
        """Load the reference policy (role="ref") from the HF-layout checkpoint in `directory`.

        Who calls it: the trainer after an SFT warm start (the reference becomes the warm-started
        policy RL starts from) and on resume. Raises ValueError without a reference (with_ref=False).
        """
        ...

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> StepResult:
        """Forward/backward every micro-batch with `loss_fn`, clip gradients, one optimizer step.

        A non-finite loss or gradient norm skips the update (StepResult.skipped) and leaves weights
        and optimizer state untouched, so the caller can stop with the last good checkpoint intact.
        """
        ...

    def set_learning_rate(self, lr: float) -> None:
        """Set the optimizer's learning rate (SFT warm start, schedules)."""
        ...

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full gathered tensor) for every weight the engine loads, in HF layout."""
        ...

    def export_base(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: (HF name, full tensor) of the frozen base the adapter trains on, what the engines must
        serve under it (the adapter pre-flight hashes it). Raises ValueError without LoRA."""
        ...

    def save(self, directory: Path, extra: dict[str, Any] | None = None) -> None:
        """Write an HF-layout checkpoint (config + safetensors) plus optimizer state, step and RNG."""
        ...

    def load(self, directory: Path) -> dict[str, Any]:
        """Restore weights, optimizer, step and RNG from `save`; return the `extra` dict saved with it."""
        ...

    def offload(self) -> None:
        """Move parameters and optimizer state off the accelerator (no-op on CPU)."""
        ...

    def onload(self) -> None:
        """Undo `offload`."""
        ...

    def close(self) -> None:
        """Release the process group and buffers."""
        ...
