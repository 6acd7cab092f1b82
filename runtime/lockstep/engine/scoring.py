"""Prompt scoring in the reference engine: SGLang's input logprobs, top-K and chosen-token logprobs.

Why it exists: a teacher (on-policy distillation, docs/distillation.md) scores the student's exact token
IDs without generating: a /generate with max_new_tokens 0, return_logprob, logprob_start_len s, and
optionally top_logprobs_num K and token_ids_logprob [ids]. The reply's meta_info then carries, for every
prompt token from s on, `input_token_logprobs` (its own logprob), `input_top_logprobs` (the K most likely
tokens at that position) and `input_token_ids_logprobs` (the logprobs of the listed IDs). This module
computes the three from the prefill logits exactly as the pinned SGLang lays them out
(managers/scheduler_components/logprob_result_processor.py): entry i belongs to prompt token s+i and is
predicted by the logits at s+i-1, so entry 0 is None whatever s is (SGLang drops the last position's
logits, which predict the first sampled token). Values are log_softmax of the raw logits (SGLang's
default: no temperature for input logprobs). With true on-policy tiles the chosen-token logprob is the
batch-invariant kernel's, the same number the trainer computes for that token.

Who calls it: lockstep.engine.scheduler (after a prefill that asked for prompt logprobs),
lockstep.engine.server (the reply).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lockstep.numerics import kernels

TokenLogprobs = list[tuple[float, int]]
"""(logprob, token ID) pairs at one position."""


@dataclass(slots=True)
class PromptScores:
    """What one prefill returns about its prompt, from logprob_start_len s to the end (P - s entries)."""

    chosen: list[float | None]
    """Logprob of each prompt token from s (entry 0 None)."""
    top: list[TokenLogprobs | None] | None = None
    """The top_logprobs_num most likely tokens per position, most likely first (entry 0 None), or
    None when not asked."""
    token_ids: list[TokenLogprobs | None] | None = None
    """Logprobs of the token_ids_logprob IDs per position, in the order asked (entry 0 None), or None."""


def score_prompt(
    tokens: list[int],
    start: int,
    prompt_len: int,
    kv_len: int,
    logits: torch.Tensor,
    *,
    top_k: int = 0,
    token_ids: list[int] | None = None,
    tiles: kernels.Tiles | None = None,
) -> PromptScores:
    """logits [T, V] of tokens[kv_len:] -> the prompt's scores from `start` (see the module doc).

    The caller guarantees kv_len <= start, so the logits predicting token start+1 are in `logits`.
    """
    n = prompt_len - start
    if n <= 1:
        return PromptScores(
            chosen=[None] * n,
            top=[None] * n if top_k > 0 else None,
            token_ids=[None] * n if token_ids is not None else None,
        )
    rows = logits[start - kv_len : prompt_len - 1 - kv_len].float()  # [n-1, V]: predict start+1 .. P-1
    targets = torch.tensor(tokens[start + 1 : prompt_len], dtype=torch.long, device=logits.device)
    logp = torch.log_softmax(rows, dim=-1)  # [n-1, V]
    if tiles is not None:
        one = torch.ones(rows.shape[0], dtype=torch.float32, device=rows.device)
        picked = kernels.token_logprobs(rows, targets, one, tiles)  # [n-1]
    else:
        picked = logp.gather(-1, targets[:, None])[:, 0]  # [n-1]
    scores = PromptScores(chosen=[None, *picked.tolist()])
    if top_k > 0:
        k = min(top_k, logp.shape[-1])
        vals, idx = logp.topk(k, dim=-1)  # [n-1, k], sorted most likely first
        scores.top = [None, *_pairs(vals, idx)]
    if token_ids is not None:
        ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
        vals = logp.index_select(-1, ids)  # [n-1, len(ids)]
        scores.token_ids = [None, *_pairs(vals, ids.expand(vals.shape[0], -1))]
    return scores


def _pairs(vals: torch.Tensor, idx: torch.Tensor) -> list[TokenLogprobs | None]:
    """[N, k] values and IDs -> N lists of (logprob, id) pairs."""
    return [list(zip(v, i, strict=True)) for v, i in zip(vals.tolist(), idx.tolist(), strict=True)]
