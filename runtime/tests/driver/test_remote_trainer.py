"""The cluster split for real: a 2-rank gloo trainer group takes the RL steps for `lockstep driver`.

`torchrun -m lockstep trainer --serve` (two ranks on loopback) serves the driver's commands; a real
reference engine on 127.0.0.1 receives the trainer's pushes; `lockstep driver --trainer-url` runs the
loop with RemoteTrainer. Covers: the engine's weight version reaches the updated version, the
train-rollout logprob abs diff is reported and small, the trainer's checkpoint holds the driver's
state, a second driver (and trainer group) resumes from it, `shutdown` ends both ranks with exit 0, a
malformed command is a 400 naming the field, an unknown one a 404, and a trainer that is down is the
clear unreachable error (exit 3).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from lockstep.cli import main
from lockstep.observability.metrics import read_jsonl

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-fast.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def engine(cache: Path) -> Iterator[str]:
    from lockstep.driver.engines import start_reference_engine
    from lockstep.models import resolve_checkpoint

    server = start_reference_engine(resolve_checkpoint("builtin:tiny", cache_dir=cache))
    try:
        yield server.url
    finally:
        server.stop()


class TrainerGroup:
    """`torchrun --nproc-per-node 2 -m lockstep trainer --serve` on loopback (gloo, CPU)."""

    def __init__(self, engine_url: str, out: Path, cache: Path, log: Path, manifest: Path = FIXTURE) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCKSTEP_ROUTER_URL": engine_url}
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
            "-m", "lockstep", "trainer", "--config", str(manifest), "--serve",
            "--host", "127.0.0.1", "--port", str(self.port), "--out", str(out), "--cache-dir", str(cache),
        ]  # fmt: skip
        self.log = log
        self.proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.url}/v2/health", timeout=2).json()["ready"]:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"trainer group not ready: {self.log.read_text()[-3000:]}")

    def stop(self) -> int:
        """The exit code after the driver's shutdown (kills the group when it did not exit)."""
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"trainer group did not exit: {self.log.read_text()[-3000:]}") from None


def _trainer_state(out: Path) -> dict[str, object]:
    latest = (out / "checkpoints" / "latest").read_text().strip()
    state: dict[str, object] = json.loads((out / "checkpoints" / latest / "trainer_state.json").read_text())
    return state


def _engine_version(url: str) -> str:
    return str(httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"])


class Group:
    """A running trainer group and the `lockstep driver` command line that talks to it."""

    def __init__(self, engine: str, tmp_path: Path, cache: Path, name: str, manifest: Path = FIXTURE) -> None:
        self.trainers = TrainerGroup(engine, tmp_path / "trainer", cache, tmp_path / f"{name}.log", manifest)
        self.manifest = manifest
        self.args = [
            "driver", "--run-dir", str(tmp_path / "driver"), "--engine-url", engine,
            "--trainer-url", self.trainers.url,
        ]  # fmt: skip

    def drive(self, *extra: str, manifest: Path | None = None) -> int:
        """`lockstep driver` against this group (`manifest`: the driver's job.yaml; same job name)."""
        code: int = main([*self.args, "--config", str(manifest or self.manifest), *extra])
        return code

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.trainers.proc.poll() is None:
            self.trainers.proc.kill()
            self.trainers.proc.wait()


def _check_wire(url: str) -> None:
    health = httpx.get(f"{url}/v2/health").json()
    assert health["world_size"] == 2 and health["job"] == "tiny-fast"
    # A bad payload never reaches the ranks: 400 naming the field; unknown commands are 404.
    bad = {"groups": [{"index": 0, "samples": [{"group_index": 0, "index": 0, "prompt_ids": [1],
           "response_ids": [5, 6], "loss_mask": [1], "rollout_logprobs": [-1.0, -1.0],
           "token_versions": [0, 0]}]}]}  # fmt: skip
    r = httpx.post(f"{url}/v2/train", json=bad)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "groups.0.samples.0" and "loss_mask has 1 entries" in r.json()["message"]
    r = httpx.post(f"{url}/v2/update_weights", json={"version": -1})
    assert r.status_code == 400 and r.json()["field"] == "version", r.text
    r = httpx.post(f"{url}/v2/save", json={"state": {"step": 1}})
    assert r.status_code == 400 and r.json()["field"].startswith("state."), r.text
    r = httpx.post(f"{url}/v2/train_harder", json={})
    assert r.status_code == 404 and "unknown command 'train_harder'" in r.json()["message"]


def _edited(tmp_path: Path, name: str, edit: dict[str, object]) -> Path:
    """The fixture with dotted-path edits (a driver-side manifest of the same job)."""
    doc = yaml.safe_load(FIXTURE.read_text())
    for dotted, value in edit.items():
        node = doc
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def test_trainer_group_takes_the_rl_steps_and_a_restarted_driver_resumes(
    tmp_path: Path,
    cache: Path,
    engine: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "trainer"
    (tmp_path / "remote_nan_reward.py").write_text("def nan(sample, response):\n    return float('nan')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    preflight: dict[str, object] = {"spec.weightSync.checkWeightUpdateEqual": True}
    job = _edited(tmp_path, "job.yaml", preflight)
    nan_job = _edited(
        tmp_path, "nan.yaml", {**preflight, "spec.agent": {"rewardFunction": "remote_nan_reward:nan"}}
    )
    with Group(engine, tmp_path, cache, "trainer", job) as group:
        group.trainers.wait_ready()
        _check_wire(group.trainers.url)
        assert group.drive("--steps", "1") == 0  # stops before the job's 3 steps: the ranks keep serving
        state = _trainer_state(out)
        assert state["step"] == 2 + 1  # optimizer steps on the ranks: the SFT warm start's two, one RL step
        assert state["extra"] == {
            "step": 1, "version": 1, "prompts_consumed": 2, "next_group_index": 2, "sft_done": True,
        }  # fmt: skip
        # A NaN loss on the ranks is the driver's exit 4; the trainer's checkpoint stays the good one.
        capsys.readouterr()
        assert group.drive(manifest=nan_job) == 4
        assert "non-finite loss" in capsys.readouterr().err
        assert _trainer_state(out)["extra"] == state["extra"]
        assert group.drive() == 0  # a restarted driver resumes from the trainer's checkpoint, to the end
        assert group.trainers.stop() == 0  # the job is done: the driver's shutdown ended both ranks
    rows = [r for r in read_jsonl(tmp_path / "driver" / "metrics.jsonl") if r["kind"] != "data"]
    kinds = ["sft", "sft", "update_weights", "train", "update_weights", "update_weights", "train", "train"]
    assert [r["kind"] for r in rows] == kinds  # the NaN run published, then stopped in its step
    assert rows[5]["weight_version"] == 1  # the resumed version went out again, no second warm start
    # The pre-flight ran on the ranks (its probe's logprobs data parallel) and reached the driver's run dir.
    assert all(r["preflight_tensors"] > 0 for r in rows if r["kind"] == "update_weights")
    result = json.loads((tmp_path / "driver" / "preflight.json").read_text())
    assert result["passed"] and result["logprob_max_abs_diff"] < 1e-3
    train = [r for r in rows if r["kind"] == "train"]
    assert [(r["step"], r["weight_version"]) for r in train] == [(1, 1), (2, 2), (3, 3)]
    for r in train:
        # The engine samples with exactly the weights the ranks sent: the mismatch is numerical noise.
        assert r["train_rollout_logprob_abs_diff"] < 1e-3, r
        # Every sampled token counted once over the two ranks' slices (2 groups x 4 samples).
        assert r["train_tokens"] == r["mismatch_tokens"] == r["response_len_mean"] * 8 > 0
    assert _engine_version(engine) == "3"
    assert not (tmp_path / "driver" / "checkpoints").exists()  # the policy's checkpoints live on the ranks
    assert sorted(p.name for p in (out / "checkpoints" / "step_000003").glob("rng_rank*.pt")) == [
        "rng_rank0.pt",
        "rng_rank1.pt",
    ]  # both ranks wrote their part
    assert _trainer_state(out)["extra"] == {
        "step": 3, "version": 3, "prompts_consumed": 6, "next_group_index": 6, "sft_done": True,
    }  # fmt: skip


@pytest.mark.slow
def test_a_new_trainer_group_resumes_from_the_checkpoint(tmp_path: Path, cache: Path, engine: str) -> None:
    """Gang restart: the whole group is replaced; the new ranks load the checkpoint, the driver resumes
    (in fully-async mode: the same commands, the engines paused by the driver around each push; the
    new group pushes by broadcast: rank 0 and the engine in one weight-update group)."""
    fully_async = _edited(
        tmp_path,
        "async.yaml",
        {
            "spec.schedule.mode": "fully-async",
            "spec.schedule.colocate": False,
            "spec.schedule.maxWeightStaleness": 2,
            "spec.weightSync.transport": "broadcast",
        },
    )
    with Group(engine, tmp_path, cache, "trainer-1") as group:
        assert group.drive("--steps", "1") == 0
        group.trainers.proc.terminate()  # the group fails as a whole (the operator restarts it)
        group.trainers.proc.wait(60)
    with Group(engine, tmp_path, cache, "trainer-2", fully_async) as group:
        assert group.drive() == 0
        assert group.trainers.stop() == 0
    train = read_jsonl(tmp_path / "driver" / "metrics.jsonl", "train")
    assert [(r["step"], r["weight_version"]) for r in train] == [(1, 1), (2, 2), (3, 3)]
    # Off-policy tokens (fully-async) make the diff non-zero; it is reported and finite.
    assert all(0.0 <= r["train_rollout_logprob_abs_diff"] < 1.0 for r in train), train
    assert _engine_version(engine) == "3"
    assert _trainer_state(tmp_path / "trainer")["extra"]["step"] == 3  # type: ignore[index]


def test_a_trainer_that_is_down_fails_clearly(
    tmp_path: Path, engine: str, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    args = ["driver", "--config", str(FIXTURE), "--run-dir", str(tmp_path), "--engine-url", engine]
    assert main([*args, "--trainer-url", url, "--trainer-timeout", "1"]) == 3
    err = capsys.readouterr().err
    assert f"trainer at {url} not ready within 1 s" in err and "lockstep trainer --serve" in err


def test_a_trainer_group_serves_fp8_engines_over_broadcast(tmp_path: Path, cache: Path) -> None:
    """The cluster's FP8 serving on loopback: the engine serves what the engine pod's init step writes
    (`lockstep convert-model`, then `lockstep engine` on it), the 2-rank trainer group accepts
    rollout precision fp8, quantizes every push with the same recipe and broadcasts it (gloo); the
    pre-flight checks the engine against the served view and the driver runs the job to the end."""
    from lockstep.driver.engines import start_reference_engine
    from lockstep.models import resolve_checkpoint

    exception = "model.layers.1.self_attn.o_proj"
    served = tmp_path / "serving" / "fp8"
    served.parent.mkdir()
    src = resolve_checkpoint("builtin:tiny", cache_dir=cache)
    args = [
        "convert-model",
        str(src),
        "--dest",
        str(served),
        "--precision",
        "fp8",
        "--bf16-modules",
        exception,
    ]
    assert main(args) == 0
    job = _edited(
        tmp_path,
        "fp8.yaml",
        {
            "spec.rollout.precision": "fp8",
            "spec.model.bf16Modules": [exception],
            "spec.weightSync": {"transport": "broadcast", "checkWeightUpdateEqual": True},
        },
    )
    server = start_reference_engine(served)
    try:
        with Group(server.url, tmp_path, cache, "fp8", job) as group:
            assert group.drive() == 0
            assert group.trainers.stop() == 0
        assert _engine_version(server.url) == "3"
    finally:
        server.stop()
    result = json.loads((tmp_path / "driver" / "preflight.json").read_text())
    assert result["passed"] and result["checked_tensors"] > 0, result
    rows = read_jsonl(tmp_path / "driver" / "metrics.jsonl")
    # the first update (through the pre-flight) and the push after each step, every one quantized
    pushes = [r for r in rows if "update_weights_quantized_tensors" in r]
    assert [r["kind"] for r in pushes] == ["update_weights", "train", "train", "train"], rows
    assert all(r["update_weights_quantized_tensors"] > 0 for r in pushes), rows
    assert all(r["update_weights_bf16_exceptions"] == 1.0 for r in pushes)
    train = [r for r in rows if r["kind"] == "train"]
    # FP8 serving, BF16 training: a small measured gap, not the BF16 run's noise
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(0.0 < r["train_rollout_logprob_abs_diff"] < 0.1 for r in train), train


def test_a_trainer_gone_at_the_shutdown_after_the_last_step_is_no_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found on the real node: the operator stops the trainer group once the driver reported `done`,
    so the ranks may be gone before the driver's shutdown call; the finished driver must exit 0
    (raising there made its pod, restartPolicy OnFailure, start the finished run again)."""
    from lockstep.driver.loop import shutdown_trainer
    from lockstep.driver.remote import RemoteTrainer

    trainer = RemoteTrainer(f"http://127.0.0.1:{_free_port()}", retries=1)  # nothing listens there
    try:
        with caplog.at_level("WARNING"):
            shutdown_trainer(trainer)
    finally:
        trainer.close()
    assert "the trainer was gone before its shutdown" in caplog.text


def _rank_pid(torchrun: int, rank: int) -> int:
    """The pid of worker `rank` among the torchrun agent's children (by its RANK environment)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == torchrun and f"RANK={rank}".encode() in env:
            return int(proc.name)
    raise AssertionError(f"no worker of rank {rank} under torchrun {torchrun}")


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_sigterm_to_a_rank_mid_run_checkpoints_and_a_new_group_loses_no_step(
    tmp_path: Path, cache: Path, engine: str, rank: int
) -> None:
    """Preemption of one trainer rank (a deleted rank pod, a drained node): rank 0 on its own SIGTERM, or
    told by rank 1 through the group's store, finishes the running command and checkpoints the steps the
    driver trained since its last save (no save interval here: without it every step would be lost), then
    the group exits; the driver sees the group gone (exit 3). A new group (the gang restart) and driver
    resume from that checkpoint: the job ends with every step trained once and every prompt drawn once."""
    import signal as signals

    # Steps enough that the job is still running when rank 0 sees a follower's notice (it polls the
    # store every 0.5 s; CI once trained all of 6 fast steps first, and the driver ended done)
    steps = 30
    job = _edited(tmp_path, "job.yaml", {"spec.schedule.steps": steps, "spec.schedule.saveInterval": None})
    with Group(engine, tmp_path, cache, "trainer-1", job) as group:
        group.trainers.wait_ready()
        with (tmp_path / "driver.log").open(
            "w"
        ) as out:  # the driver as a process: it installs signal handlers
            driver = subprocess.Popen(
                [sys.executable, "-m", "lockstep", *group.args, "--config", str(job)],
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        metrics = tmp_path / "driver" / "metrics.jsonl"
        deadline = time.monotonic() + 900  # a hang guard, not a timing assertion
        while len(read_jsonl(metrics, "train", raw=True)) < 2:
            assert driver.poll() is None and time.monotonic() < deadline, (
                tmp_path / "driver.log"
            ).read_text()[-3000:]
            time.sleep(0.1)
        os.kill(_rank_pid(group.trainers.proc.pid, rank), signals.SIGTERM)
        # The signalled rank exits 0, the other one STOPPED_EARLY_EXIT (the job is not done: its pod
        # must not end Succeeded), so torchrun's group fails (1) and the operator restarts the gang.
        assert group.trainers.proc.wait(300) == 1, group.trainers.log.read_text()[-3000:]
        assert f"rank {1 - rank}: the trainer group stopped before the driver's shutdown" in (
            group.trainers.log.read_text()
        )
        code = driver.wait(300)
    assert code == 3, (tmp_path / "driver.log").read_text()[-3000:]  # the trainer group left: resumable
    trained = max(r["step"] for r in read_jsonl(metrics, "train"))
    state = _trainer_state(tmp_path / "trainer")
    # every step the group trained is in the checkpoint (without it: none, there is no save interval)
    assert state["extra"]["step"] == trained >= 2, (state["extra"], trained)  # type: ignore[index]
    assert "SIGTERM: checkpointed step" in group.trainers.log.read_text()
    with Group(engine, tmp_path, cache, "trainer-2", job) as group:
        assert group.drive() == 0
        assert group.trainers.stop() == 0
    data = read_jsonl(metrics, "data")
    assert [r["step"] for r in data] == list(range(1, steps + 1))
    per_step = len(data[0]["positions"])
    assert [p for r in data for p in r["positions"]] == list(
        range(steps * per_step)
    )  # each prompt once, in order
