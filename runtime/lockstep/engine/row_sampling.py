"""Sampling one engine step so that a failing row fails alone.

Why it exists: the sampling of a step is one batched call over every running sequence. Requests are
validated first (lockstep.serving.sampling_limits), but a row can still fail at sampling time: NaN or
infinite logits from the model, a distribution that keeps no token. One such row used to make the
batched call throw, and the scheduler then aborted every sequence of the step. Here a failed batch is
sampled again row by row: the rows that fail are reported with the error, the others get their
tokens, and the scheduler aborts only the failed ones (lockstep.engine.core).

Who calls it: lockstep.engine.core (the worker thread, once per step).
"""

from __future__ import annotations

import logging
import math

import torch

from lockstep.engine.runner import SamplingBatch, sample
from lockstep.numerics import kernels

log = logging.getLogger(__name__)


def _row(params: SamplingBatch, i: int) -> SamplingBatch:
    return SamplingBatch(
        temperature=params.temperature[i : i + 1],
        top_p=params.top_p[i : i + 1],
        top_k=params.top_k[i : i + 1],
        generators=[params.generators[i]],
    )


def sample_rows(
    logits: torch.Tensor,
    params: SamplingBatch,
    generator: torch.Generator,
    tiles: kernels.Tiles | None = None,
) -> tuple[list[int], list[float], list[str | None]]:
    """Sample logits [B, V] like `runner.sample`; returns (ids, logprobs, errors), errors[i] naming why
    row i could not be sampled (its id and logprob are then placeholders), None for good rows.

    The batched call runs first (the normal path, bit for bit what `sample` returns); only when it
    raises, or returns a non-finite logprob, is each row sampled alone."""
    n = int(logits.shape[0])
    try:
        ids, lps = sample(logits, params, generator, tiles)
    except (RuntimeError, ValueError) as e:
        log.warning("sampling a batch of %d rows failed (%s); sampling row by row", n, e)
    else:
        bad = [i for i, lp in enumerate(lps) if not math.isfinite(lp)]
        if not bad:
            return ids, lps, [None] * n
        errors: list[str | None] = [None] * n
        for i in bad:
            errors[i] = f"the sampled token's logprob is {lps[i]} (non-finite logits)"
        return ids, lps, errors
    ids, lps, errors = [0] * n, [0.0] * n, [None] * n
    for i in range(n):
        try:
            (tok,), (lp,) = sample(logits[i : i + 1], _row(params, i), generator, tiles)
        except (RuntimeError, ValueError) as e:
            errors[i] = f"sampling failed: {type(e).__name__}: {e}"
            continue
        if not math.isfinite(lp):
            errors[i] = f"the sampled token's logprob is {lp} (non-finite logits)"
        ids[i], lps[i] = tok, lp
    return ids, lps, errors
