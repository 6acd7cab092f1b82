"""The driver's part of on-policy distillation: the teachers' engines, the tokenizer check, the scorer.

Why it exists: OPD (docs/distillation.md) needs, before step 1, a served teacher per teacher of
spec.algorithm.opd and the proof that each maps every token ID as the student does; during the run a
scorer that every finished sample passes through (Rollout.scorer) and a report per step. Where a
teacher is served:
- `url`: that SGLang server;
- `checkpoint`: in a cluster the operator's teacher pool (`<job>-teacher-<name>`), whose router URL the
  operator passes in LOCKSTEP_TEACHER_URLS; under `lockstep run`, `replicas` reference engines started
  here from the checkpoint, never updated;
- `poolRef`: the standalone teacher pool's router URL, from LOCKSTEP_TEACHER_URLS, opened with that pool's
  own API key (LOCKSTEP_TEACHER_API_KEY_<NAME>, from its Secret; in a cluster only).

Who calls it: lockstep.driver.components (build_opd), the loops (opd_metrics).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lockstep.api import TEACHER_URLS_ENV, teacher_api_key_env
from lockstep.driver.engines import EngineServer, start_reference_engine
from lockstep.models import resolve_checkpoint
from lockstep.rollout.opd.config import OPDConfig, TeacherSetup, TeacherSource
from lockstep.rollout.opd.scorer import ScoringPool, TeacherScorer
from lockstep.rollout.opd.tokenizers import check_same_tokenizer
from lockstep.serving.client import EngineClient
from lockstep.serving.loop import LoopThread

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TeacherEndpoints:
    """Where each teacher is served, resolved for this process."""

    urls: dict[str, list[str]]
    """Teacher name -> base URLs of its engines (one router URL in a cluster)."""
    engines: list[EngineServer]
    """Engines this process started (checkpoint teachers under `lockstep run`)."""
    api_keys: dict[str, str] = field(default_factory=dict)
    """Teacher name -> the API key of the pool serving it, where it is not the job's own (a standalone
    teacher pool, poolRef); the others are opened with LOCKSTEP_API_KEY."""


def teacher_urls_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """LOCKSTEP_TEACHER_URLS (a JSON object name -> base URL, set by the operator), {} when unset."""
    raw = environ.get(TEACHER_URLS_ENV)
    if not raw:
        return {}
    try:
        urls = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{TEACHER_URLS_ENV} is not JSON ({e}); the operator writes an object name -> url"
        ) from e
    if not isinstance(urls, dict) or not all(isinstance(v, str) for v in urls.values()):
        raise ValueError(f"{TEACHER_URLS_ENV} must be a JSON object of teacher name -> base URL")
    return {str(k): v for k, v in urls.items()}


def resolve_teachers(
    setup: TeacherSetup,
    *,
    cache_dir: Path | None,
    closers: list[Callable[[], None]],
    environ: Mapping[str, str] = os.environ,
    device: str = "cpu",
) -> TeacherEndpoints:
    """Each teacher's engines: the env's URL (a cluster), its url, or engines started here."""
    given = teacher_urls_from_env(environ)
    out = TeacherEndpoints({}, [])
    for teacher in setup.sources:
        if teacher.name in given:
            out.urls[teacher.name] = [given[teacher.name]]
            if key := environ.get(teacher_api_key_env(teacher.name)):  # a standalone pool's own key
                out.api_keys[teacher.name] = key
        elif teacher.url is not None:
            out.urls[teacher.name] = [teacher.url]
        elif teacher.checkpoint is not None:
            servers = _start_teacher(setup, teacher, cache_dir, closers, device)
            out.engines += servers
            out.urls[teacher.name] = [s.url for s in servers]
        else:
            raise ValueError(
                f"spec.algorithm.opd.teachers[{teacher.name}].poolRef: a standalone pool is reached through "
                f"the cluster (the operator passes its router in {TEACHER_URLS_ENV}); outside a cluster "
                "give the teacher a url or a checkpoint"
            )
    return out


def _start_teacher(
    setup: TeacherSetup,
    teacher: TeacherSource,
    cache_dir: Path | None,
    closers: list[Callable[[], None]],
    device: str,
) -> list[EngineServer]:
    """`teacher.replicas` reference engines on the teacher's checkpoint, never updated."""
    assert teacher.checkpoint is not None
    model_dir = resolve_checkpoint(teacher.checkpoint, cache_dir=cache_dir, seed=setup.seed)
    servers = []
    for _ in range(teacher.replicas):
        server = start_reference_engine(
            model_dir,
            device=device,
            true_on_policy=setup.true_on_policy,  # the teacher computes as the student's engines do
            kv_cache_dtype=setup.kv_cache_dtype,
        )
        closers.append(server.stop)
        servers.append(server)
    log.info("teacher %s: %d reference engine(s) on %s", teacher.name, len(servers), model_dir)
    return servers


def build_opd(
    config: OPDConfig,
    runner: LoopThread,
    endpoints: TeacherEndpoints,
    student: Sequence[EngineClient],
    vocab_size: int,
    closers: list[Callable[[], None]],
    *,
    ready_timeout_s: float,
) -> TeacherScorer:
    """Clients of every teacher (waited for), the tokenizer check against the student's engine, and the
    scorer. Raises TokenizerMismatch naming the first differing token ID."""
    clients = {
        name: [EngineClient(u, api_key=endpoints.api_keys.get(name)) for u in urls]
        for name, urls in endpoints.urls.items()
    }

    def close_clients() -> None:
        for cs in clients.values():
            for c in cs:
                runner.run(c.aclose())

    closers.append(close_clients)
    for name, cs in clients.items():
        for c in cs:
            runner.run(c.wait_ready(timeout_s=ready_timeout_s))
        n = runner.run(check_same_tokenizer(name, cs[0].detokenize, student[0].detokenize, vocab_size))
        log.info("teacher %s: the same string for each of %d token IDs as the student", name, n)
    return TeacherScorer(
        config=config,
        teachers={name: ScoringPool(f"teacher {name}", cs) for name, cs in clients.items()},
        student=ScoringPool("the student's engine", student) if config.candidate_set != "sampled" else None,
    )


def opd_metrics(scorer: TeacherScorer | None) -> dict[str, float]:
    """The step's OPD report from the scorer ({} without OPD)."""
    return scorer.drain_metrics() if scorer is not None else {}
