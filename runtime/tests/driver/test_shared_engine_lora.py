"""Two LoRA jobs share one `lockstep engine` (multi-LoRA on one machine), as two jobs share a pool.

One real engine process serves the base with --enable-lora; two `lockstep run --engine-url` processes
train their own adapters on it at the same time. What must hold, checked from the engine itself
(GET /engine_stats: tokens sampled per adapter name, adapters loaded):
- both jobs finish, each having sampled only with its own adapter versions (`<job>-v<version>`);
- a job stopped mid-run (Ctrl-C, what a deleted job's pods get) unloads its adapters and the other
  job goes on to finish, unaffected;
- a job killed hard (SIGKILL: no close) leaves its versions loaded; the next run of its adapter name
  unloads them when it first reaches the engine, and the other job goes on, unaffected;
- an engine without --enable-lora, or with a --max-lora-rank below the job's rank, fails the job
  before its first step, naming the reason (SGLang's own refusal);
- an engine serving another base than the trainer's (one element of one tensor off by 1e-6, which
  the logprob probe cannot see) fails the pre-flight naming that tensor; the base is never written.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from lockstep.models.tiny import materialize_builtin
from lockstep.observability.metrics import read_jsonl
from safetensors.torch import load_file, save_file
from subprocesses import until

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-fast.yaml"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine(tmp: Path, *flags: str) -> tuple[str, subprocess.Popen[bytes], Path]:
    port, log = _port(), tmp / f"engine-{len(flags)}.log"
    cmd = [sys.executable, "-m", "lockstep", "engine", "--model", "builtin:tiny", "--port", str(port), *flags]
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    until("the engine", lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, proc, log)
    return url, proc, log


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, proc, _ = _engine(tmp_path_factory.mktemp("engine"), "--enable-lora", "--max-lora-rank", "8")
    try:
        yield url
    finally:
        _stop(proc)


def _job(tmp: Path, name: str, steps: int, rank: int = 4, checkpoint: str | None = None) -> Path:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["metadata"]["name"] = name
    if checkpoint is not None:
        doc["spec"]["model"]["checkpoint"] = checkpoint
    doc["spec"]["model"]["lora"] = {"rank": rank, "alpha": 2 * rank}
    doc["spec"]["schedule"] = {"steps": steps, "saveInterval": 1}
    doc["spec"]["weightSync"] = {"transport": "broadcast", "checkWeightUpdateEqual": True}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _run(
    tmp: Path,
    name: str,
    engine: str,
    steps: int,
    rank: int = 4,
    checkpoint: str | None = None,
    run_dir: Path | None = None,
) -> subprocess.Popen[bytes]:
    job = _job(tmp, name, steps, rank, checkpoint)
    cmd = [sys.executable, "-m", "lockstep", "run", str(job), "--engine-url", engine]
    cmd += ["--run-dir", str(run_dir or tmp / name)]
    log = (tmp / f"{name}.log").open("w")
    return subprocess.Popen(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT
    )


def _stats(engine: str) -> dict[str, object]:
    reply: dict[str, object] = httpx.get(f"{engine}/engine_stats", timeout=10).json()
    return reply


def _tail(tmp: Path, name: str) -> str:
    return (tmp / f"{name}.log").read_text()[-3000:]


def test_two_jobs_share_one_engine_and_a_stopped_job_leaves_the_other_alone(
    engine: str, tmp_path: Path
) -> None:
    a = _run(tmp_path, "job-a", engine, steps=40)
    b = _run(tmp_path, "job-b", engine, steps=6)
    try:
        # job-a is stopped (Ctrl-C) once it has published a few versions; job-b runs on meanwhile
        until(
            "job-a's third version",
            lambda: any(str(n).startswith("job-a-v3") for n in _stats(engine)["loaded_adapters"]),  # type: ignore[union-attr]
            a,
            tmp_path / "job-a.log",
            timeout_s=600,
        )
        a.send_signal(signal.SIGINT)
        assert a.wait(300) == 0, _tail(tmp_path, "job-a")
        assert b.wait(600) == 0, _tail(tmp_path, "job-b")
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
    stats = _stats(engine)
    assert stats["loaded_adapters"] == {}, stats  # both jobs took their adapters with them
    tokens: dict[str, int] = stats["adapter_tokens"]  # type: ignore[assignment]
    assert {n.rsplit("-v", 1)[0] for n in tokens} == {"job-a", "job-b"}, tokens
    assert any(n.startswith("job-b-v6") for n in tokens) or any(n.startswith("job-b-v5") for n in tokens)
    b_train = read_jsonl(tmp_path / "job-b" / "metrics.jsonl", "train")
    assert [r["step"] for r in b_train] == [1, 2, 3, 4, 5, 6]
    for r in b_train:  # job-b sampled its own adapter all along: the engine's logprobs are its trainer's
        assert r["train_rollout_logprob_abs_diff"] < 1e-4, r
    a_train = read_jsonl(tmp_path / "job-a" / "metrics.jsonl", "train")
    assert 3 <= len(a_train) < 40  # stopped mid-run, with a checkpoint
    assert "unloaded" not in _tail(tmp_path, "job-b")


def test_a_hard_killed_jobs_adapters_are_unloaded_by_the_next_run_of_its_name_and_the_other_job_goes_on(
    engine: str, tmp_path: Path
) -> None:
    def loaded() -> list[str]:
        return sorted(_stats(engine)["loaded_adapters"])  # type: ignore[arg-type]

    c = _run(tmp_path, "job-c", engine, steps=40)
    d = _run(tmp_path, "job-d", engine, steps=8)
    try:
        until(
            "job-c's fourth version", lambda: "job-c-v4" in loaded(), c, tmp_path / "job-c.log", timeout_s=600
        )
        c.kill()  # SIGKILL: no close, nothing unloads its versions
        c.wait(60)
        left = [n for n in loaded() if n.startswith("job-c-")]
        assert left and all(int(n.rsplit("-v", 1)[1]) > 2 for n in left), (
            left
        )  # beyond what the next run loads
        # the job created again (a new run dir: it starts over at version 0 and stops at 2)
        again = _run(tmp_path, "job-c", engine, steps=2, run_dir=tmp_path / "job-c-again")
        assert again.wait(600) == 0, _tail(tmp_path, "job-c")
        assert d.wait(600) == 0, _tail(tmp_path, "job-d")
    finally:
        for p in (c, d):
            if p.poll() is None:
                p.kill()
    assert loaded() == [], loaded()  # the killed run's versions went with the next run of its name
    assert "that no running job loaded" in _tail(tmp_path, "job-c")
    d_train = read_jsonl(tmp_path / "job-d" / "metrics.jsonl", "train")
    assert [r["step"] for r in d_train] == list(range(1, 9))
    for r in d_train:  # job-d sampled its own adapter all along, through the kill and the sweep
        assert r["train_rollout_logprob_abs_diff"] < 1e-4, r


def test_an_engine_without_lora_or_with_a_smaller_max_rank_fails_the_job_before_step_one(
    engine: str, tmp_path: Path
) -> None:
    job = _run(tmp_path, "too-big", engine, steps=2, rank=16)
    assert job.wait(300) != 0
    assert "rank 16 is incompatible" in _tail(tmp_path, "too-big") and "--max-lora-rank is 8" in _tail(
        tmp_path, "too-big"
    )
    assert not (tmp_path / "too-big" / "metrics.jsonl").exists() or not read_jsonl(
        tmp_path / "too-big" / "metrics.jsonl", "train"
    )
    url, proc, _ = _engine(tmp_path)  # no --enable-lora
    try:
        plain = _run(tmp_path, "no-lora", url, steps=2)
        assert plain.wait(300) != 0
        assert "--enable-lora" in _tail(tmp_path, "no-lora")
    finally:
        _stop(proc)


def test_an_engine_serving_another_base_fails_the_preflight_naming_the_first_differing_tensor(
    tmp_path: Path,
) -> None:
    base = materialize_builtin("tiny", tmp_path / "base", seed=0)
    other = materialize_builtin("tiny", tmp_path / "other", seed=0)
    weights = load_file(str(other / "model.safetensors"))
    off = "model.layers.1.mlp.down_proj.weight"
    weights[off][0, 0] += 1e-6  # the logprob probe cannot see this; the checksums must
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    before = load_file(str(base / "model.safetensors"))
    url, proc, _ = _engine(tmp_path, "--model", str(other), "--enable-lora", "--max-lora-rank", "8")
    try:
        job = _run(tmp_path, "other-base", url, steps=2, checkpoint=str(base))
        assert job.wait(300) != 0, _tail(tmp_path, "other-base")
        assert _stats(url)["loaded_adapters"] == {}  # the failed job took its first version with it
    finally:
        _stop(proc)
    tail = _tail(tmp_path, "other-base")
    assert f"first differing tensor {off}" in tail and "spec.weightSync.checkWeightUpdateEqual" in tail, tail
    result = (tmp_path / "other-base" / "preflight.json").read_text()
    assert '"passed": false' in result and off in result
    after = load_file(str(base / "model.safetensors"))
    assert all(torch.equal(after[k], before[k]) for k in before)  # the trainer's base was never written
