"""Per-token logprobs of given token IDs from logits: the one definition every backend uses.

Why it exists: the mismatch metrics are only meaningful if the trainer's logprob means exactly what
the engine's `output_token_logprobs` means: log softmax(logits / temperature) at the sampled token.
(SGLang returns the logprob of the distribution it sampled from, i.e. after temperature scaling;
the reference engine follows it.) Computed in float32 whatever the model dtype.

Who calls it: lockstep.train.fsdp (and any future backend).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockstep.numerics import kernels, sglang_kernels

if TYPE_CHECKING:
    import torch


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    tiles: kernels.Tiles | None = None,
) -> torch.Tensor:
    """Logprob of input_ids[:, t+1] under logits[:, t]; returns [B, T-1] float32.

    logits: [B, T, V]; input_ids: [B, T]. Uses logsumexp instead of a full log_softmax tensor to keep
    peak memory at one [B, T-1, V] float32 buffer. With `tiles` (true on-policy) the logprobs are
    lockstep.numerics.kernels.token_logprobs, the engine's own computation.
    """
    import torch

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to define logprobs, got {temperature}")
    if tiles is not None:
        b, t, v = logits.shape
        flat = logits[:, :-1].reshape(-1, v)  # [B*(T-1), V]
        temp = torch.full((flat.shape[0],), temperature, dtype=torch.float32, device=logits.device)
        ids = input_ids[:, 1:].reshape(-1)
        return kernels.token_logprobs(flat, ids, temp, tiles).view(b, t - 1)
    scaled = logits[:, :-1].float() / temperature  # [B, T-1, V]
    target = input_ids[:, 1:].unsqueeze(-1)  # [B, T-1, 1]
    picked = torch.gather(scaled, -1, target).squeeze(-1)  # [B, T-1]
    return picked - torch.logsumexp(scaled, dim=-1)


def sglang_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logprob of input_ids[:, t+1] under logits[:, t] as stock SGLang's on-policy sampler computes
    it (lockstep.numerics.sglang_kernels.token_logprobs: log_softmax of bf16(bf16(logits) /
    temperature)); returns [B, T-1] float32 (bf16 values)."""
    import torch

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to define logprobs, got {temperature}")
    b, t, v = logits.shape
    flat = logits[:, :-1].reshape(-1, v)  # [B*(T-1), V]
    temp = torch.full((flat.shape[0],), temperature, dtype=torch.float32, device=logits.device)
    ids = input_ids[:, 1:].reshape(-1)
    return sglang_kernels.token_logprobs(flat, ids, temp).view(b, t - 1)
