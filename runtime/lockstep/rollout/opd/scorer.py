"""TeacherScorer: route a finished sample to its teacher and attach the teacher's scores of its tokens.

Why it exists: §8.1 with a served teacher. For each sample the rollout finished (single-turn, an
agent's TITO session rows, sync or fully-async alike: the scores follow the stored token rows, never a
re-rendered text), the label under opd.labelKey in the prompt's data picks exactly one teacher
(config.route: no route and no default stops the run, naming the label). The teacher scores the row's
exact IDs (prompt + response) from the last prompt token on, without generating
(lockstep.serving.scoring). Then:
- sampled-token OPD: Sample.teacher_logprobs holds log q(y_t) per response token; the trainer forms
  d_t = log p_old(y_t) - log q(y_t) with its own pre-update logprobs;
- a candidate set: the student's engine scores the same row too (its top-K, and the teacher's top-K IDs
  by ID when the set needs them, lockstep.rollout.opd.candidates.needs), and Sample.opd_logratio holds
  the set's d_t per response token, computed here where both models' scores are. The student's scores
  come from the engine's weights when it scores (in a sync step, the version that sampled the row).
Tokens the policy did not sample (tool results, loss mask 0) get 0.0. With taskReward zero the sample's
reward becomes 0 after the task reward is kept in metadata["task_reward"] (logged, never trained on).

Teacher scores are taken when the sample finishes, as its reward is, so fully-async staleness rules
apply to them as to rewards: a teacher is never updated, so its scores never age; the group's staleness
is its tokens' versions, bounded by schedule.maxWeightStaleness as always.

Every request is counted per teacher (`drain_metrics`): samples, tokens scored, latency, the tokens each
server computed and the reply bytes (the cost of a candidate set against the sampled token).

Who calls it: lockstep.rollout.generate (Rollout.run_sample awaits it), lockstep.driver (builds it,
drains its metrics every step).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lockstep.rollout.fatal import StopsTheRun
from lockstep.rollout.opd.candidates import candidate_set, logratio, needs
from lockstep.rollout.opd.config import OPDConfig
from lockstep.serving.client import EngineError
from lockstep.serving.scoring import Candidates, ScoredRow
from lockstep.types import Sample, SampleStatus

log = logging.getLogger(__name__)


class TeacherError(StopsTheRun, RuntimeError):
    """A teacher (or the student's engine, for a candidate set) refused or mis-scored a row."""


class ScoresRows(Protocol):
    """A served model that scores exact rows (EngineClient.score)."""

    async def score(
        self, ids: Sequence[int], start: int, *, top_k: int = 0, token_ids: Sequence[int] | None = None
    ) -> ScoredRow: ...


class ScoringPool:
    """The replicas of one served model, round-robin per scoring request."""

    def __init__(self, name: str, clients: Sequence[ScoresRows]) -> None:
        if not clients:
            raise ValueError(f"{name}: no engine to score with")
        self.name = name
        """Whose engines (a teacher's name, or `student`): named in errors."""
        self.clients = list(clients)
        """One client per replica."""
        self._next = itertools.cycle(range(len(self.clients)))

    async def score(
        self, ids: Sequence[int], start: int, *, top_k: int = 0, token_ids: Sequence[int] | None = None
    ) -> ScoredRow:
        client = self.clients[next(self._next)]
        try:
            return await client.score(ids, start, top_k=top_k, token_ids=token_ids)
        except (EngineError, ValueError) as e:
            raise TeacherError(f"{self.name}: scoring a row of {len(ids)} tokens failed: {e}") from e


@dataclass(slots=True)
class _Tally:
    """What one served model did since the last drain."""

    samples: int = 0
    tokens: int = 0
    requests: int = 0
    latency_s: float = 0.0
    latency_max_s: float = 0.0
    computed_tokens: int = 0
    reply_bytes: int = 0

    def add(self, row: ScoredRow, latency_s: float) -> None:
        self.requests += 1
        self.latency_s += latency_s
        self.latency_max_s = max(self.latency_max_s, latency_s)
        self.computed_tokens += row.prompt_tokens - row.cached_tokens
        self.reply_bytes += row.reply_bytes


@dataclass(slots=True)
class _Step:
    """Everything counted since the last drain."""

    served: dict[str, _Tally] = field(default_factory=dict)
    task_rewards: list[float] = field(default_factory=list)
    set_sizes: int = 0
    positions: int = 0
    empty_sets: int = 0


class TeacherScorer:
    """Scores finished samples (see the module doc). Call it as `await scorer(sample)`."""

    def __init__(
        self,
        *,
        config: OPDConfig,
        teachers: Mapping[str, ScoringPool],
        student: ScoringPool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        missing = [t for t in config.teachers if t not in teachers]
        if missing:
            raise ValueError(f"spec.algorithm.opd: no engines for teachers {missing}")
        if config.candidate_set != "sampled" and student is None:
            raise ValueError("a candidate set needs the student's engines to score rows too")
        self.config = config
        self.teachers = dict(teachers)
        self.student = student
        self.clock = clock
        self._step = _Step()

    async def __call__(self, sample: Sample) -> Sample:
        if sample.status in (SampleStatus.ABORTED, SampleStatus.FAILED):
            return sample  # never trained on: nothing to score
        label = sample.metadata.get(self.config.label_key)
        teacher = self.config.route(label)
        sample.label = label if isinstance(label, str) else sample.label
        sample.teacher = teacher
        ids = [*sample.prompt_ids, *sample.response_ids]
        start = len(sample.prompt_ids) - 1  # entry 0 (the last prompt token) is null; entry j+1 = token j
        if self.config.candidate_set == "sampled":
            row = await self._timed(teacher, ids, start)
            sample.teacher_logprobs = _response_values(row.chosen, sample.loss_mask, f"teacher {teacher}")
        else:
            await self._candidates(sample, teacher, ids, start)
        self._count(sample, teacher)
        return sample

    async def _timed(
        self, who: str, ids: list[int], start: int, *, top_k: int = 0, token_ids: Sequence[int] | None = None
    ) -> ScoredRow:
        pool = self.student if who == "" else self.teachers[who]
        assert pool is not None
        t0 = self.clock()
        row = await pool.score(ids, start, top_k=top_k, token_ids=token_ids)
        self._step.served.setdefault(who or "student", _Tally()).add(row, self.clock() - t0)
        return row

    async def _candidates(self, sample: Sample, teacher: str, ids: list[int], start: int) -> None:
        cfg, need = self.config, needs(self.config.candidate_set)
        k = cfg.top_k
        t_row, s_row = await asyncio.gather(
            self._timed(teacher, ids, start, top_k=k if need.teacher_top else 0),
            self._timed("", ids, start, top_k=k) if need.student_top else _none(),
        )
        trained = [j + 1 for j, m in enumerate(sample.loss_mask) if m]  # entries of trained tokens
        s_ids = _ids_at(s_row.top if s_row else None, trained)
        t_ids = _ids_at(t_row.top, trained)
        t_more, s_more = await asyncio.gather(
            self._timed(teacher, ids, start, token_ids=s_ids) if need.teacher_at_student_ids and s_ids else _none(),
            self._timed("", ids, start, token_ids=t_ids) if need.student_at_teacher_ids and t_ids else _none(),
        )  # fmt: skip
        sample.teacher_logprobs = _response_values(t_row.chosen, sample.loss_mask, f"teacher {teacher}")
        out = [0.0] * len(sample.loss_mask)
        for entry in trained:
            s_top = _at(s_row.top if s_row else None, entry)
            t_top = _at(t_row.top, entry)
            student = {**dict(s_top), **dict(_at(s_more.token_ids if s_more else None, entry))}
            teach = {**dict(t_top), **dict(_at(t_more.token_ids if t_more else None, entry))}
            if s_row is not None:  # the student's logprob of the sampled token is known too
                chosen = s_row.chosen[entry]
                if chosen is not None:
                    student.setdefault(ids[start + entry], chosen)
            cands = candidate_set(cfg.candidate_set, [v for v, _ in s_top], [v for v, _ in t_top])
            try:
                out[entry - 1] = logratio(cands, student, teach, cfg.weight)
            except KeyError as e:
                raise TeacherError(
                    f"candidate set {cfg.candidate_set}: no logprob of token {e} at response position "
                    f"{entry - 1} from one of the servers (it did not return the IDs it was asked for)"
                ) from e
            self._step.set_sizes += len(cands)
            self._step.positions += 1
            self._step.empty_sets += not cands
        sample.opd_logratio = out

    def _count(self, sample: Sample, teacher: str) -> None:
        task = sample.reward if sample.reward is not None else 0.0
        sample.metadata["task_reward"] = task
        self._step.task_rewards.append(task)
        if self.config.zero_task_reward:
            sample.reward = 0.0  # pure distillation: the teacher's signal is the only one
        tally = self._step.served.setdefault(teacher, _Tally())
        tally.samples += 1
        tally.tokens += sum(sample.loss_mask)

    def drain_metrics(self) -> dict[str, float]:
        """The report since the last drain (a step): per teacher and in total, samples and tokens scored,
        mean and max request latency, the tokens each server computed and its reply bytes; for candidate
        sets the mean set size and the share of empty sets; the mean task reward of the scored samples."""
        step, self._step = self._step, _Step()
        out: dict[str, float] = {}
        teachers = [step.served[t] for t in self.config.teachers if t in step.served]
        for name, t in step.served.items():
            prefix = f"opd_{name}_"
            out[prefix + "samples"] = float(t.samples)
            out[prefix + "tokens"] = float(t.tokens)
            out[prefix + "latency_s_mean"] = t.latency_s / t.requests if t.requests else 0.0
            out[prefix + "computed_tokens"] = float(t.computed_tokens)
            out[prefix + "reply_bytes"] = float(t.reply_bytes)
        requests = sum(t.requests for t in teachers)
        out |= {
            "opd_samples_scored": float(sum(t.samples for t in teachers)),
            "opd_teacher_tokens": float(sum(t.tokens for t in teachers)),
            "opd_teacher_latency_s_mean": sum(t.latency_s for t in teachers) / requests if requests else 0.0,
            "opd_teacher_latency_s_max": max((t.latency_max_s for t in teachers), default=0.0),
            "opd_teacher_computed_tokens": float(sum(t.computed_tokens for t in teachers)),
            "opd_teacher_reply_bytes": float(sum(t.reply_bytes for t in teachers)),
        }
        if step.task_rewards:
            out["task_reward_mean"] = sum(step.task_rewards) / len(step.task_rewards)
        if step.positions:
            out["opd_candidate_set_size_mean"] = step.set_sizes / step.positions
            out["opd_candidate_empty_frac"] = step.empty_sets / step.positions
        return out


async def _none() -> None:
    return None


def _at(rows: list[Candidates | None] | None, entry: int) -> Candidates:
    """A position's (id, logprob) pairs, [] when absent."""
    if rows is None:
        return []
    return rows[entry] or []


def _ids_at(rows: list[Candidates | None] | None, entries: Sequence[int]) -> list[int]:
    """The IDs of `rows` at `entries`, each once, in first-seen order (one token_ids_logprob list per row)."""
    return list(dict.fromkeys(v for e in entries for v, _ in _at(rows, e)))


def _response_values(chosen: list[float | None], mask: list[int], who: str) -> list[float]:
    """Per response token: the logprob at entry j+1 where the token trains, 0.0 elsewhere; a trained
    token without a value is the server's error."""
    out = []
    for j, m in enumerate(mask):
        v = chosen[j + 1] if m else 0.0
        if v is None:
            raise TeacherError(f"{who} returned no logprob for response token {j}")
        out.append(float(v))
    return out
