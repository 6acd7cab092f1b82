"""A poolRef teacher is opened with its own pool's API key (docs/distillation.md, "Teachers are served").

A standalone teacher pool's engines take that pool's key, not the job's. In a cluster the operator gives
the driver the pool's router in LOCKSTEP_TEACHER_URLS and the pool's key in LOCKSTEP_TEACHER_API_KEY_<NAME>
(from the pool's Secret). Here two real reference engines on 127.0.0.1 play both sides: the student's
with the job's key, the teacher's with another key. With the teacher's key the driver passes the
tokenizer check against the teacher (every ID decoded there); with the job's key alone the teacher
refuses it (401) and the run stops saying which key it needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from lockstep.api import TEACHER_URLS_ENV, teacher_api_key_env
from lockstep.driver.engines import EngineServer, start_reference_engine
from lockstep.driver.opd import build_opd, resolve_teachers
from lockstep.models.tiny import materialize_builtin
from lockstep.rollout.opd.config import OPDConfig, TeacherSetup, TeacherSource
from lockstep.rollout.opd.tokenizers import TeacherRefused
from lockstep.serving import EngineClient
from lockstep.serving.loop import LoopThread

VOCAB = 92
CONFIG = OPDConfig(
    teachers=("tutor-1",),
    routes={},
    default_teacher="tutor-1",
    label_key="label",
    zero_task_reward=False,
    candidate_set="sampled",
    top_k=1,
    weight="student",
)
SETUP = TeacherSetup(sources=(TeacherSource(name="tutor-1", pool="tutors"),))


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineServer]]:
    model = materialize_builtin("builtin:tiny", tmp_path_factory.mktemp("key") / "m", seed=0)
    student = start_reference_engine(model, api_key="job-key")
    teacher = start_reference_engine(model, api_key="pool-key")
    yield {"student": student, "teacher": teacher}
    student.stop()
    teacher.stop()


def _check(
    engines: dict[str, EngineServer], environ: dict[str, str], closers: list[Callable[[], None]]
) -> None:
    endpoints = resolve_teachers(SETUP, cache_dir=None, closers=closers, environ=environ)
    runner = LoopThread()
    closers.append(runner.close)
    student = EngineClient(engines["student"].url, api_key="job-key")
    closers.append(lambda: runner.run(student.aclose()))
    build_opd(CONFIG, runner, endpoints, [student], VOCAB, closers, ready_timeout_s=30)


def _close(closers: list[Callable[[], None]]) -> None:
    for close in reversed(closers):
        close()


def test_the_driver_opens_a_standalone_teacher_pool_with_that_pools_key(
    engines: dict[str, EngineServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCKSTEP_API_KEY", "job-key")  # the job's key, which the teacher does not take
    urls = f'{{"tutor-1": "{engines["teacher"].url}"}}'
    assert teacher_api_key_env("tutor-1") == "LOCKSTEP_TEACHER_API_KEY_TUTOR_1"
    closers: list[Callable[[], None]] = []
    try:
        _check(engines, {TEACHER_URLS_ENV: urls, "LOCKSTEP_TEACHER_API_KEY_TUTOR_1": "pool-key"}, closers)
    finally:
        _close(closers)
    closers = []
    try:
        with pytest.raises(TeacherRefused, match=r"teachers\[tutor-1\]: the teacher refused the driver"):
            _check(engines, {TEACHER_URLS_ENV: urls}, closers)
    finally:
        _close(closers)


def test_a_pool_ref_teacher_outside_a_cluster_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"teachers\[tutor-1\]\.poolRef: .* give the teacher a url or a checkpoint"
    ):
        resolve_teachers(SETUP, cache_dir=tmp_path, closers=[], environ={})
