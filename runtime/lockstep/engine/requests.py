"""One request inside the reference engine: its Sequence, its validation, its errors and counters.

Why it exists: the HTTP server builds a Sequence from a /generate body, the scheduler (scheduler.py)
steps it and the server answers from it; all three agree on this one shape. A request is checked here,
field by field, before it reaches a kernel: one request's bad value must never fail a batch it
shares with others.

Who calls it: lockstep.engine.core (new_sequence), lockstep.engine.scheduler, lockstep.engine.server.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from lockstep.engine.scoring import PromptScores
from lockstep.serving.payloads import SamplingParams
from lockstep.serving.sampling_limits import sampling_problem


class EngineInputError(ValueError):
    """A request the engine cannot serve; the message names the field and the fix (HTTP 400)."""


class EngineBusy(RuntimeError):
    """The queue is full or the engine is draining: retry later (HTTP 503 with Retry-After)."""


MAX_TOP_K = 2**31 - 1
"""top_k beyond the vocabulary keeps every token; larger values are refused before any kernel."""
MAX_STOP_TOKEN_IDS = 1024
"""stop_token_ids entries per request."""
SEED_RANGE = (-(2**63), 2**64)
"""sampling_seed must fit torch.Generator.manual_seed."""


@dataclass(slots=True)
class Sequence:
    """One request being generated. tokens = prompt + output; KV is valid for tokens[:kv_len]."""

    rid: str
    """Request ID."""
    prompt_len: int
    """P, the prompt length."""
    tokens: list[int]
    """Prompt then output token IDs."""
    params: SamplingParams
    """The request's sampling parameters."""
    stop_ids: frozenset[int]
    """Token IDs that end the sample."""
    max_new: int
    """Output budget (max_new_tokens capped by the context length)."""
    future: asyncio.Future[Sequence]
    """Resolved when the sequence finishes."""
    generator: torch.Generator | None = None
    """Seeded generator when sampling_seed is set."""
    input_logprob_start: int = -1
    """Prompt position from which prompt logprobs are returned; -1: none."""
    logprobs: list[float] = field(default_factory=list)
    """Logprob of each output token."""
    versions: list[int] = field(default_factory=list)
    """Weight version that sampled each output token."""
    top_logprobs_num: int = 0
    """Prompt positions: how many most likely tokens to return at each (0: none)."""
    token_ids_logprob: list[int] | None = None
    """Prompt positions: the token IDs whose logprobs to return at each (None: none)."""
    input_scores: PromptScores | None = None
    """Prompt scores from input_logprob_start once prefilled (lockstep.engine.scoring; entry 0 None)."""
    slot: int = -1
    """Owned KV slot, -1 when waiting."""
    kv_len: int = 0
    """Tokens whose KV is in the slot."""
    cached_tokens: int = -1
    """Prompt tokens reused from the prefix cache at first admission; -1 before admission."""
    finish: dict[str, Any] | None = None
    """SGLang finish_reason JSON once finished."""
    abort_requested: bool = False
    """Set by /abort_request; handled between steps."""
    created: float = 0.0
    """time.monotonic() at submit, for e2e_latency."""
    return_routed_experts: bool = False
    """R3: record the routed expert IDs of this sequence's tokens (MoE models only)."""
    routed_experts: bytes | None = None
    """R3 payload once finished by stop or length: int32 [n-1, layers, top-k], little-endian."""
    adapter: str | None = None
    """The LoRA adapter this sequence samples with (/generate's lora_path); None: the base alone."""

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]


SESSION_KEYS_KEPT = 4096
"""Session keys EngineStats.session_turns remembers (a long-lived engine serves sessions without end)."""
SESSION_KEY_MAX_CHARS = 128
"""Longer keys are not counted: the header is the client's, and the session server's keys are 32 hex
characters; the cap keeps the stats at most SESSION_KEYS_KEPT x this many characters."""


@dataclass(slots=True)
class EngineStats:
    """Counters since start (exposed at GET /engine_stats)."""

    prompt_tokens: int = 0
    """Prompt tokens of admitted requests."""
    cached_tokens: int = 0
    """Of those, tokens reused from the prefix cache."""
    generated_tokens: int = 0
    """Tokens sampled."""
    steps: int = 0
    """Scheduler steps run."""
    requests: int = 0
    """Requests finished (any reason)."""
    failed_steps: int = 0
    """Steps that raised (their sequences were aborted with the error)."""
    failed_rows: int = 0
    """Sequences aborted because their own row of a step could not be sampled (the others went on)."""
    adapter_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens sampled per LoRA adapter name (`lora_path`); which policy generated what, seen from the
    engine (several jobs share one engine)."""
    session_turns: OrderedDict[str, int] = field(default_factory=OrderedDict)
    """/generate requests served per session key (the X-SMG-Routing-Key header the session server sends
    with every turn), the SESSION_KEYS_KEPT most recent keys: which sessions this engine served."""

    def count_turn(self, session_key: str) -> None:
        """One more /generate served for `session_key` (the oldest key is forgotten past the cap; a key
        over SESSION_KEY_MAX_CHARS is not counted)."""
        if len(session_key) > SESSION_KEY_MAX_CHARS:
            return
        self.session_turns[session_key] = self.session_turns.pop(session_key, 0) + 1
        if len(self.session_turns) > SESSION_KEYS_KEPT:
            self.session_turns.popitem(last=False)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def validate(
    ids: list[int], p: SamplingParams, logprob_start_len: int, *, context_length: int, vocab_size: int
) -> None:
    """Raise EngineInputError naming the field and the fix unless the engine can serve this request."""
    if not ids:
        raise EngineInputError("input_ids is empty; send at least one prompt token")
    if len(ids) >= context_length:
        raise EngineInputError(
            f"input_ids has {len(ids)} tokens; the context length is {context_length} "
            "(shorten the prompt or start the engine with a larger --context-length)"
        )
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise EngineInputError(f"input_ids contains {bad}, outside the vocabulary [0, {vocab_size})")
    if p.stop:
        raise EngineInputError("sampling_params.stop (stop strings) is not supported; use stop_token_ids")
    if p.min_p:
        raise EngineInputError(
            "sampling_params.min_p is not supported by the reference engine; use top_p/top_k"
        )
    _check_sampling(p)
    if logprob_start_len >= len(ids):
        raise EngineInputError(
            f"logprob_start_len {logprob_start_len} must be < the prompt length {len(ids)}"
        )


def _check_sampling(p: SamplingParams) -> None:
    """Bounds of every sampling parameter, checked before a kernel sees it (EngineInputError naming
    the field); one request's bad value must never fail a batch it shares with others."""
    if not math.isfinite(p.min_p):
        raise EngineInputError(f"sampling_params.min_p is {p.min_p}; send a finite number")
    problem = sampling_problem(p.temperature, p.top_p)  # at float32, the precision sampling runs at
    if problem:
        raise EngineInputError(problem)
    if p.top_k != -1 and not 1 <= p.top_k <= MAX_TOP_K:
        raise EngineInputError(f"sampling_params.top_k {p.top_k}: use -1 (all tokens) or 1..{MAX_TOP_K}")
    if p.max_new_tokens > 2**31:
        raise EngineInputError(f"sampling_params.max_new_tokens {p.max_new_tokens}: at most 2**31")
    if p.stop_token_ids is not None and len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise EngineInputError(
            f"sampling_params.stop_token_ids has {len(p.stop_token_ids)} entries; at most {MAX_STOP_TOKEN_IDS}"
        )
    if p.sampling_seed is not None and not SEED_RANGE[0] <= p.sampling_seed < SEED_RANGE[1]:
        raise EngineInputError(f"sampling_params.sampling_seed {p.sampling_seed}: must fit 64 bits")


MAX_SCORED_IDS = 65536
"""token_ids_logprob entries per request (each costs one value per scored position)."""


def validate_scoring(
    p: SamplingParams,
    logprob_start_len: int,
    top_logprobs_num: int,
    token_ids_logprob: list[int] | None,
    *,
    vocab_size: int,
) -> None:
    """Raise EngineInputError unless this engine can serve the request's top-K / chosen-ID logprobs:
    prompt positions of a scoring request (max_new_tokens 0, logprob_start_len >= 0) only."""
    if not top_logprobs_num and token_ids_logprob is None:
        return
    if top_logprobs_num < 0:
        raise EngineInputError(f"top_logprobs_num {top_logprobs_num}: use 0 (none) or a positive count")
    if p.max_new_tokens != 0 or logprob_start_len < 0:
        raise EngineInputError(
            "top_logprobs_num / token_ids_logprob: the reference engine returns them for prompt positions "
            "only; send max_new_tokens 0 and logprob_start_len >= 0 (a scoring request)"
        )
    if token_ids_logprob is not None:
        if len(token_ids_logprob) > MAX_SCORED_IDS:
            raise EngineInputError(
                f"token_ids_logprob has {len(token_ids_logprob)} IDs; at most {MAX_SCORED_IDS}"
            )
        bad = next((t for t in token_ids_logprob if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise EngineInputError(
                f"token_ids_logprob contains {bad}, outside the vocabulary [0, {vocab_size})"
            )
