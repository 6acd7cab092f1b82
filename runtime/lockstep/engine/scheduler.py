"""The reference engine's scheduler: continuous batching over the runner's KV slots, pause modes.

Why it exists: this is the engine's step loop, apart from how weights are held (live_weights.py) and how
tensors are computed (runner.py); lockstep.engine.core wires the three together.

How a step works (a task on the event loop; tensor work runs on the engine's one worker thread):
1. admit waiting sequences into free slots (up to max_prefill_tokens per step), reusing the KV of
   the longest cached token prefix: a free slot that holds it is taken in place, a running slot's
   prefix is copied; a sequence whose prompt shares a longer prefix with one admitted in the same
   step waits one step so it can reuse that KV;
2. prefill the admitted sequences together (right-padded), sample their next token;
3. decode every other running sequence together, one token each;
4. append tokens, logprobs and the current weight version; finish on a stop token, the budget or
   the context length; answer finished requests.
A finished sequence's slot keeps its KV as prefix cache until the slot is needed (LRU, slots.py).

R3 (MoE models): a sequence submitted with return_routed_experts gets, when it finishes by stop or
length, the expert IDs the runner recorded for its tokens 0..n-2 (`Sequence.routed_experts`, int32
[n-1, layers, top-k]; n = prompt + output tokens). The last sampled token was never run through the
model, so it has no routing, as in SGLang. Aborted sequences carry none.

Pause modes (SGLang's): abort ends running and waiting requests; retract moves running sequences
back to the waiting queue keeping their tokens (their KV is recomputed after continue, under the
weights of that time, and later tokens carry the new version); in_place stops stepping and keeps KV.

Who calls it: lockstep.engine.core (ReferenceEngine owns one Scheduler).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lockstep.engine.lora import AdapterSet
from lockstep.engine.requests import EngineBusy, EngineInputError, EngineStats, Sequence
from lockstep.engine.row_sampling import sample_rows
from lockstep.engine.runner import SamplingBatch
from lockstep.engine.scoring import PromptScores, score_prompt
from lockstep.engine.slots import SlotTable, common_prefix

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]

StepResults = tuple[list[int], list[float], dict[int, PromptScores], list[str | None]]
"""Sampled token IDs and their logprobs (prefill rows that sample, then decode rows), prompt
scores by prefill index, and per sampled row the error that kept it from being sampled (None: sampled;
lockstep.engine.row_sampling)."""


@dataclass(slots=True)
class _Plan:
    """The tensor work of one step, built on the event loop and run on the worker thread."""

    copies: list[tuple[int, int, int]]
    """(src slot, dst slot, length) prefix copies before prefill."""
    prefill: list[Sequence]
    """Sequences to prefill from their kv_len."""
    decode: list[Sequence]
    """Running sequences to advance one token."""
    version: int
    """The weight version of this step."""


class Scheduler:
    """See the module doc. Every step and every weight or pause operation holds `lock`."""

    def __init__(
        self,
        runner: Any,
        *,
        device: torch.device,
        version: Callable[[], int],
        run_in_worker: Callable[..., Awaitable[Any]],
        max_prefill_tokens: int,
        max_queued_requests: int,
    ) -> None:
        """runner: a ModelRunner or RecomputeRunner; version: the weight version served now;
        run_in_worker: runs a function on the engine's tensor thread."""
        self.runner = runner
        self.device = device
        self._version = version
        self._run_in_worker = run_in_worker
        self.max_prefill_tokens = max_prefill_tokens
        """Prompt tokens admitted per step."""
        self.max_queued_requests = max_queued_requests
        """Sequences waiting or running at once; more are refused with EngineBusy (HTTP 503)."""
        self.stats = EngineStats()
        """Counters, including the prefix-cache hit rate."""
        self.draining = False
        """Set on shutdown: new requests are refused with EngineBusy."""
        self.slots = SlotTable(runner.max_slots)
        self.waiting: deque[Sequence] = deque()
        self.by_rid: dict[str, Sequence] = {}
        """Every queued or running sequence by request ID."""
        self.paused = False
        self.adapters: AdapterSet | None = None
        """The engine's LoRA adapters (ReferenceEngine.enable_lora), applied per row of each step."""
        self.lock = asyncio.Lock()  # held for every step and every weight/pause operation
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the step loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="lockstep-engine-scheduler")

    async def stop(self, message: str) -> None:
        """Stop the step loop and abort what is left with `message`."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.abort_all(message)

    # -- requests ------------------------------------------------------------------------------

    async def submit_many(self, seqs: list[Sequence]) -> list[Sequence]:
        """Queue sequences all or none (EngineInputError on a duplicate rid, EngineBusy when they do
        not fit), then wait until every one finishes."""
        rids = [s.rid for s in seqs]
        dup = next((r for r in rids if r in self.by_rid), None)
        if dup is not None or len(set(rids)) != len(rids):
            raise EngineInputError(f"rid {dup!r} is already running; request IDs must be unique")
        self.check_capacity(len(seqs))
        for seq in seqs:
            self.by_rid[seq.rid] = seq
            self.waiting.append(seq)
        self._wake.set()
        return list(await asyncio.gather(*(self._wait(s) for s in seqs)))

    async def _wait(self, seq: Sequence) -> Sequence:
        try:
            return await asyncio.shield(seq.future)
        except asyncio.CancelledError:  # the HTTP client went away: stop spending steps on it
            if seq.finish is None:
                self.finish(seq, {"type": "abort", "message": "client disconnected"})
            raise
        finally:
            self.by_rid.pop(seq.rid, None)

    def check_capacity(self, n: int) -> None:
        """Raise EngineBusy unless `n` more sequences fit the queue (and the engine is not draining)."""
        if self.draining:
            raise EngineBusy("the engine is shutting down; send the request to another engine")
        queued = len(self.by_rid)
        if queued + n > self.max_queued_requests:
            raise EngineBusy(
                f"{queued} requests queued or running, {n} more would pass max_queued_requests "
                f"{self.max_queued_requests}; retry later"
            )

    async def abort(self, rid: str | None, message: str) -> None:
        """Abort one request (by rid) or all; their replies carry finish_reason type abort."""
        async with self.lock:
            if rid is None:
                self.abort_all(message)
                return
            seq = self.by_rid.get(rid)
            if seq is not None and seq.finish is None:
                self.finish(seq, {"type": "abort", "message": message})

    def abort_all(self, message: str) -> None:
        for seq in [*self.waiting, *self.slots.running.values()]:
            self.finish(seq, {"type": "abort", "message": message})

    # -- pause / continue ------------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> None:
        """Stop stepping after the current step; see the module doc for the modes."""
        if mode not in ("abort", "retract", "in_place"):
            raise EngineInputError(f"mode={mode!r}: use abort, retract or in_place")
        async with self.lock:
            self.paused = True
            if mode == "abort":
                self.abort_all("aborted by /pause_generation")
            elif mode == "retract":
                for seq in self.slots.retract():
                    self.waiting.appendleft(seq)

    def resume(self) -> None:
        """Continue after pause (SGLang's /continue_generation)."""
        self.paused = False
        self._wake.set()

    # -- steps -------------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if self.paused or not (self.waiting or self.slots.running):
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self.lock:
                if self.paused:
                    continue
                self._reap_aborted()
                plan = self._plan()
                if plan.prefill or plan.decode:
                    try:
                        results = await self._run_in_worker(self._execute, plan)
                    except Exception as e:  # never leave requests waiting on a dead scheduler
                        self._fail_step(plan, e)
                    else:
                        self._apply(plan, results)
            # Let handlers (abort, pause, new requests) in between steps; back off if nothing ran.
            await asyncio.sleep(0 if plan.prefill or plan.decode else 0.005)

    def _fail_step(self, plan: _Plan, error: Exception) -> None:
        """A step raised: log it, abort the sequences it touched (their KV is unknown), keep serving."""
        log.exception("engine step failed; aborting %d sequences", len(plan.prefill) + len(plan.decode))
        self.stats.failed_steps += 1
        for seq in [*plan.prefill, *plan.decode]:
            if seq.finish is None:
                self.finish(
                    seq, {"type": "abort", "message": f"engine step failed: {type(error).__name__}: {error}"}
                )
            slot = seq.slot
            self.slots.release(seq)
            if slot >= 0:
                self.slots.cached[slot] = []  # the step may have half-written this KV

    def _reap_aborted(self) -> None:
        for seq in [s for s in self.slots.running.values() if s.finish is not None]:
            self.slots.release(seq)

    def _plan(self) -> _Plan:
        slots = self.slots
        copies: list[tuple[int, int, int]] = []
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        taken: set[int] = set()
        deferred: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            cap = len(seq.tokens) - 1  # the last token is always recomputed, for its logits
            if seq.input_logprob_start >= 0:
                cap = min(cap, max(seq.input_logprob_start - 1, 0))
            best, best_len = slots.longest_prefix(seq.tokens, cap, taken, seq.adapter)
            if any(
                a.adapter == seq.adapter and common_prefix(a.tokens, seq.tokens, cap) > best_len
                for a in admitted
            ):
                deferred.append(self.waiting.popleft())  # reuse that KV next step
                continue
            if best >= 0 and best not in slots.running:
                slot: int | None = best
            else:
                slot = slots.free_slot(taken | ({best} if best >= 0 else set()))
                if slot is not None and best >= 0:
                    copies.append((best, slot, best_len))
            if slot is None:
                break
            self.waiting.popleft()
            taken.add(slot)
            budget -= len(seq.tokens) - best_len
            seq.slot, seq.kv_len = slot, best_len
            slots.cached[slot] = []  # while running, the sequence describes the slot
            if seq.cached_tokens < 0:
                seq.cached_tokens = best_len
                self.stats.prompt_tokens += seq.prompt_len
                self.stats.cached_tokens += best_len
            admitted.append(seq)
        self.waiting.extendleft(reversed(deferred))
        decode = [s for s in slots.running.values() if s.finish is None]
        for seq in admitted:
            slots.running[seq.slot] = seq
        return _Plan(copies=copies, prefill=admitted, decode=decode, version=self._version())

    def _execute(self, plan: _Plan) -> StepResults:
        """Worker thread: run the plan's tensor work; returns (tokens, logprobs) for prefill then decode."""
        try:
            return self._execute_rows(plan)
        finally:
            if self.adapters is not None:
                self.adapters.clear_batch()

    def _execute_rows(self, plan: _Plan) -> StepResults:
        runner = self.runner
        for src, dst, n in plan.copies:
            runner.copy_prefix(src, dst, n)
        logits: list[torch.Tensor] = []
        seqs: list[Sequence] = []
        prompt_lp: dict[int, PromptScores] = {}
        if plan.prefill:
            rows = [s.tokens[s.kv_len :] for s in plan.prefill]
            want = {
                i for i, s in enumerate(plan.prefill) if s.input_logprob_start >= 0 and s.input_scores is None
            }
            if self.adapters is not None:  # each prefill row's LoRA adapter (lockstep.engine.lora)
                self.adapters.set_batch([s.adapter for s in plan.prefill], self.device)
            last, full = runner.prefill(
                rows, [s.kv_len for s in plan.prefill], [s.slot for s in plan.prefill], want
            )
            for i, lg in full.items():
                q = plan.prefill[i]
                prompt_lp[i] = score_prompt(
                    q.tokens, q.input_logprob_start, q.prompt_len, q.kv_len, lg,
                    top_k=q.top_logprobs_num, token_ids=q.token_ids_logprob, tiles=runner.tiles,
                )  # fmt: skip
            keep = [i for i, s in enumerate(plan.prefill) if s.max_new > len(s.output_ids)]
            logits.append(last[keep])
            seqs.extend(plan.prefill[i] for i in keep)
        if plan.decode:
            n = max(s.slot for s in plan.decode) + 1
            toks, pos = [0] * n, [runner.context_length] * n
            for s in plan.decode:
                toks[s.slot], pos[s.slot] = s.tokens[-1], len(s.tokens) - 1
            if self.adapters is not None:  # decode rows are slots 0..n-1
                by_slot: list[str | None] = [None] * n
                for s in plan.decode:
                    by_slot[s.slot] = s.adapter
                self.adapters.set_batch(by_slot, self.device)
            out = runner.decode(toks, pos, n)
            logits.append(out[torch.tensor([s.slot for s in plan.decode], device=out.device)])
            seqs.extend(plan.decode)
        if not seqs:
            return [], [], prompt_lp, []
        params = SamplingBatch(
            temperature=torch.tensor([s.params.temperature for s in seqs], device=self.device),
            top_p=torch.tensor([s.params.top_p for s in seqs], device=self.device),
            top_k=torch.tensor([s.params.top_k for s in seqs], device=self.device),
            generators=[s.generator for s in seqs],
        )
        ids, lps, errors = sample_rows(torch.cat(logits), params, runner.generator, runner.tiles)
        return ids, lps, prompt_lp, errors

    def _apply(self, plan: _Plan, results: StepResults) -> None:
        ids, lps, prompt_lp, errors = results
        self.stats.steps += 1
        for i, plp in prompt_lp.items():
            plan.prefill[i].input_scores = plp
        for seq in plan.prefill:
            seq.kv_len = len(seq.tokens)
        for seq in plan.decode:
            seq.kv_len = len(seq.tokens)
        sampled = [s for s in plan.prefill if s.max_new > len(s.output_ids)] + plan.decode
        for seq, tok, lp, error in zip(sampled, ids, lps, errors, strict=True):
            if seq.finish is not None:  # aborted while the step ran
                continue
            if error is not None:  # this row alone could not be sampled: it alone is aborted
                self.stats.failed_rows += 1
                self.finish(
                    seq, {"type": "abort", "message": f"engine step failed for this request: {error}"}
                )
                continue
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(plan.version)
            self.stats.generated_tokens += 1
            if seq.adapter is not None:
                self.stats.adapter_tokens[seq.adapter] = self.stats.adapter_tokens.get(seq.adapter, 0) + 1
            if tok in seq.stop_ids:
                self.finish(seq, {"type": "stop", "matched": tok})
            elif len(seq.output_ids) >= seq.max_new:
                self.finish(seq, {"type": "length", "length": seq.max_new})
        for seq in plan.prefill:
            if seq.finish is None and seq.max_new <= len(seq.output_ids):
                self.finish(seq, {"type": "length", "length": seq.max_new})
        for seq in [*plan.prefill, *plan.decode]:
            if seq.slot >= 0:
                self.slots.touch(seq.slot)
            if seq.finish is not None:
                if seq.return_routed_experts and seq.slot >= 0 and seq.finish.get("type") != "abort":
                    # The worker is idle here (steps run under the lock), so the slot's routing is stable.
                    seq.routed_experts = self.runner.read_routes(seq.slot, len(seq.tokens) - 1)
                self.slots.release(seq)

    def finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        """End a sequence with SGLang's finish_reason and answer its waiter."""
        seq.finish = reason
        if seq.slot < 0 and seq in self.waiting:
            self.waiting.remove(seq)
        if not seq.future.done():
            seq.future.set_result(seq)
        self.stats.requests += 1
