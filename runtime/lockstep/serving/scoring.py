"""Scoring exact token IDs on an SGLang server without generating, and reading its tokenizer.

Why it exists: on-policy distillation (docs/distillation.md) needs a served model (a teacher, or the
student's own engine for a candidate set) to say how likely each token of a stored row is, for the
row's own IDs. SGLang's API for it is /generate with max_new_tokens 0: `return_logprob`,
`logprob_start_len` s, `top_logprobs_num` K and `token_ids_logprob` [ids] return, per prompt token from
s, the token's logprob, the K most likely tokens and the listed IDs' logprobs (meta_info
input_token_logprobs / input_top_logprobs / input_token_ids_logprobs; entry 0 is null: nothing of the
request predicts token s). `score_request` builds that body, `parse_scores` reads the reply into
per-token lists, and `ScoredRow` says what one request cost (prompt tokens computed, reply bytes).
`/v1/detokenize` (SGLang's OpenAI-protocol route) decodes ID lists one string each: the tokenizer check
compares two servers ID by ID through it.

Who calls it: lockstep.serving.client (EngineClient.score, EngineClient.detokenize), lockstep.rollout.opd.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lockstep.serving.payloads import GenerateReply, GenerateRequest, SamplingParams

Candidates = list[tuple[int, float]]
"""(token ID, logprob) pairs at one position."""


@dataclass(slots=True)
class ScoredRow:
    """A served model's scores of one row's tokens from `start` on (all lists have len(ids) - start entries)."""

    start: int
    """The first scored position (logprob_start_len)."""
    chosen: list[float | None]
    """Logprob of the row's own token at each position (entry 0 None)."""
    top: list[Candidates | None] | None
    """The K most likely tokens at each position, most likely first (entry 0 None); None when not asked."""
    token_ids: list[Candidates | None] | None
    """The asked IDs' logprobs at each position (entry 0 None); None when not asked."""
    prompt_tokens: int
    """Tokens the server ran (the whole row)."""
    cached_tokens: int
    """Of those, tokens served from its prefix cache."""
    reply_bytes: int
    """Size of the reply body: the wire cost of the scores."""


def score_request(
    ids: Sequence[int], start: int, *, top_k: int = 0, token_ids: Sequence[int] | None = None
) -> GenerateRequest:
    """The /generate body that scores `ids` from position `start` without sampling."""
    if not 0 <= start < len(ids):
        raise ValueError(f"score: start {start} must be inside the row of {len(ids)} tokens")
    return GenerateRequest(
        input_ids=list(ids),
        sampling_params=SamplingParams(max_new_tokens=0, temperature=1.0),
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=top_k,
        token_ids_logprob=list(token_ids) if token_ids else None,
    )


def _candidates(rows: list[list[list[Any]] | None] | None, n: int, what: str) -> list[Candidates | None]:
    if rows is None or len(rows) != n:
        got = "none" if rows is None else len(rows)
        raise ValueError(f"the server returned {got} {what} entries for {n} scored tokens")
    out: list[Candidates | None] = []
    for row in rows:
        out.append(None if row is None else [(int(t[1]), float(t[0])) for t in row])
    return out


def parse_scores(
    reply: GenerateReply, ids: Sequence[int], start: int, *, top_k: int, token_ids: bool, reply_bytes: int
) -> ScoredRow:
    """A /generate scoring reply -> ScoredRow; ValueError when the server scored other tokens than
    asked (a reply whose IDs differ from the row is never used: it would score another sequence)."""
    meta = reply.meta_info
    n = len(ids) - start
    rows = meta.input_token_logprobs
    if rows is None or len(rows) != n:
        got = "no" if rows is None else len(rows)
        raise ValueError(f"the server returned {got} input_token_logprobs for {n} scored tokens")
    echoed = [int(t[1]) for t in rows]
    if echoed != list(ids[start:]):
        first = next(i for i, (a, b) in enumerate(zip(echoed, ids[start:], strict=True)) if a != b)
        raise ValueError(
            f"the server scored token {echoed[first]} at position {start + first}, the row holds "
            f"{ids[start + first]}: it does not score the IDs it is sent"
        )
    return ScoredRow(
        start=start,
        chosen=[None if t[0] is None else float(t[0]) for t in rows],
        top=_candidates(meta.input_top_logprobs, n, "input_top_logprobs") if top_k > 0 else None,
        token_ids=_candidates(meta.input_token_ids_logprobs, n, "input_token_ids_logprobs")
        if token_ids
        else None,
        prompt_tokens=meta.prompt_tokens,
        cached_tokens=meta.cached_tokens,
        reply_bytes=reply_bytes,
    )
