"""`lockstep run` end to end on the tiny model: real engine on 127.0.0.1, FSDP2 trainer, in-process weights.

Covers the loop (initial push, steps, save, publish), resume (step, version, data position), Ctrl-C
(a real SIGINT: the step finishes and a resumable checkpoint is left), a NaN loss (stops, last good
checkpoint intact), an unreachable engine and manifest errors (clear message, exit code).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from lockstep.cli import main
from lockstep.observability.metrics import read_jsonl

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-fast.yaml"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _manifest(tmp_path: Path, edit: dict[str, object] | None = None) -> Path:
    doc = yaml.safe_load(FIXTURE.read_text())
    for dotted, value in (edit or {}).items():
        node = doc
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _state(run_dir: Path) -> dict[str, object]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    state: dict[str, object] = json.loads(
        (run_dir / "checkpoints" / latest / "trainer_state.json").read_text()
    )
    return state


def test_run_then_resume(tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    args = ["run", str(FIXTURE), "--run-dir", str(run_dir), "--cache-dir", str(cache)]
    assert main([*args, "--steps", "3"]) == 0
    assert "done: step 3, reward " in capsys.readouterr().out
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] != "data"]
    kinds = [r["kind"] for r in rows]
    assert kinds == ["sft", "sft", "update_weights", "train", "train", "train"]
    data = read_jsonl(run_dir / "metrics.jsonl", "data")  # the data positions each step trained on
    assert [r["positions"] for r in data] == [[0, 1], [2, 3], [4, 5]]
    publish = rows[2]
    assert publish["weight_version"] == 0  # the trainer's weights reached the engine before step 1
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert [r["weight_version"] for r in train] == [1, 2, 3]
    for r in train:
        # The engine scores with exactly the trainer's weights (handed over in memory each step): same logprobs.
        assert r["train_rollout_logprob_abs_diff"] < 1e-3, r
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["mismatch_tokens"] > 0
        # `auto` with the embedded engine is the in-process handoff: nothing on the wire or the disk,
        # the time in the engine's load, every phase summing to the update's seconds
        assert r["update_weights_wire_bytes"] == 0 and r["update_weights_engine_load_s"] > 0
        phases = sum(
            v
            for k, v in r.items()
            if k.startswith("update_weights_") and k.endswith("_s") and k != "update_weights_s"
        )
        assert abs(phases - r["update_weights_s"]) < 1e-6
    assert (run_dir / "metrics.png").stat().st_size > 0
    assert not (run_dir / "weights").exists()  # no full checkpoint per version (from-disk's weights/)
    state = _state(run_dir)
    assert state["step"] == 2 + 3  # optimizer steps: the SFT warm start's two, then three RL steps
    assert state["extra"] == {
        "step": 3,
        "version": 3,
        "prompts_consumed": 6,
        "next_group_index": 6,
        "sft_done": True,
    }

    assert main([*args, "--steps", "4", "--resume"]) == 0
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] != "data"]
    assert [r["kind"] for r in rows[6:]] == ["update_weights", "train"]  # no second SFT warm start
    assert rows[6]["weight_version"] == 3 and rows[7]["step"] == 4 and rows[7]["weight_version"] == 4
    assert _state(run_dir)["extra"] == {
        "step": 4, "version": 4, "prompts_consumed": 8, "next_group_index": 8, "sft_done": True,
    }  # fmt: skip


def test_sft_target_lr_schedule_and_dynamic_sampling_through_the_loop(tmp_path: Path, cache: Path) -> None:
    run_dir = tmp_path / "run"
    job = _manifest(
        tmp_path,
        {
            # the untrained loss (~4) is below this target: the warm start ends after its 5-step window
            "spec.algorithm.sftWarmStart": {"steps": 50, "learningRate": 0.003, "stopAtLoss": 50.0},
            "spec.algorithm.lrSchedule": {"warmupSteps": 1, "decay": "linear", "minLearningRate": 1e-5},
            "spec.algorithm.dynamicSampling": {"maxGroupsPerStep": 6},
        },
    )
    assert main(["run", str(job), "--run-dir", str(run_dir), "--cache-dir", str(cache)]) == 0
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert sum(r["kind"] == "sft" for r in rows) == 5
    train = [r for r in rows if r["kind"] == "train"]
    # spec.schedule.steps 3: warmup step 1 at the peak / 1, then linear from the peak towards 1e-5
    assert [r["learning_rate"] for r in train] == pytest.approx([3e-4, 3e-4, 1e-5 + (3e-4 - 1e-5) / 2])
    for r in train:
        generated, dropped = r["groups_generated"], r["groups_dropped"]
        assert 2 <= generated <= 6 and 0 <= dropped <= generated
        kept = generated - dropped
        # rounds go on until a batch (2) has a reward spread or the cap (6) is reached, never past either
        assert kept <= 2 and (kept == 2 or generated == 6)
        assert r["generated_zero_variance_groups_frac"] == pytest.approx(dropped / generated)
        if kept == 2:
            assert r["zero_variance_groups_frac"] == 0.0  # the trained groups all have a spread
    assert _state(run_dir)["extra"]["prompts_consumed"] == sum(r["groups_generated"] for r in train)  # type: ignore[index]


def test_kl_reference_is_the_warm_started_policy_and_survives_resume(tmp_path: Path, cache: Path) -> None:
    """spec.algorithm.kl after an SFT warm start compares with the warm-started policy, not the checkpoint
    as loaded: RL step 1 trains the policy the reference holds (KL exactly 0), and a resumed run reads the
    same reference back from RUN_DIR/reference (the same KL as a run without the stop)."""
    job = _manifest(tmp_path, {"spec.algorithm.kl": {"coef": 0.5}, "spec.schedule.saveInterval": 2})
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert main(["run", str(job), "--run-dir", str(straight), "--cache-dir", str(cache)]) == 0
    train = read_jsonl(straight / "metrics.jsonl", "train")
    assert train[0]["kl_ref"] == 0.0  # against the checkpoint as loaded: 0.03 after the 2 SFT steps
    assert train[1]["kl_ref"] > 0.0 and train[2]["kl_ref"] > 0.0  # RL moved away from it
    assert (straight / "reference" / "model.safetensors").is_file()

    args = ["run", str(job), "--run-dir", str(stopped), "--cache-dir", str(cache)]
    assert main([*args, "--steps", "2"]) == 0
    assert main([*args, "--resume"]) == 0
    resumed = read_jsonl(stopped / "metrics.jsonl", "train")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert resumed[2]["kl_ref"] == pytest.approx(train[2]["kl_ref"], rel=1e-4)


def test_sigint_finishes_the_step_and_leaves_a_checkpoint(tmp_path: Path, cache: Path) -> None:
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"

    def interrupt_after_first_step() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not read_jsonl(metrics, "train"):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.getsignal(signal.SIGINT)
    threading.Thread(target=interrupt_after_first_step, daemon=True).start()
    try:
        code = main(
            ["run", str(FIXTURE), "--run-dir", str(run_dir), "--cache-dir", str(cache), "--steps", "50"]
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 0
    steps = [r["step"] for r in read_jsonl(metrics, "train")]
    assert 1 <= len(steps) < 50
    assert _state(run_dir)["extra"]["step"] == steps[-1]  # type: ignore[index]  # the finished step was saved


REWARDS = """
def nan_after_two_steps(sample, response):
    # Batch = 2 groups: groups 4 and 5 are drawn by step 3.
    return float("nan") if sample.group_index >= 4 else 0.5 + 0.1 * sample.index

def by_index(sample, response):
    # Rewards that differ inside every group: nonzero advantages, so every step changes the weights.
    return 0.1 * sample.index
"""


@pytest.fixture
def reward_module(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "lockstep_test_rewards.py").write_text(textwrap.dedent(REWARDS))
    sys.path.insert(0, str(tmp_path))
    yield "lockstep_test_rewards"
    sys.path.remove(str(tmp_path))
    sys.modules.pop("lockstep_test_rewards", None)


def test_nan_loss_stops_with_the_last_good_checkpoint(
    tmp_path: Path, cache: Path, reward_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = _manifest(tmp_path, {"spec.agent.rewardFunction": f"{reward_module}:nan_after_two_steps"})
    run_dir = tmp_path / "run"
    code = main(["run", str(manifest), "--run-dir", str(run_dir), "--cache-dir", str(cache), "--steps", "5"])
    assert code == 4
    assert "non-finite loss" in capsys.readouterr().err
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert _state(run_dir)["extra"]["step"] == 2  # type: ignore[index]
    assert not (run_dir / "checkpoints" / "step_000003").exists()
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl", "train")] == [1, 2]


def test_unreachable_engine_fails_clearly(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    url = f"http://127.0.0.1:{port}"
    args = ["run", str(FIXTURE), "--run-dir", str(tmp_path), "--cache-dir", str(cache)]
    assert main([*args, "--engine-url", url, "--engine-timeout", "1"]) == 3
    err = capsys.readouterr().err
    assert f"rollout engine at {url}/health unreachable" in err and "check that the engine is running" in err


def test_manifest_errors_name_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _manifest(tmp_path, {"spec.algorithm.samplesPerPrompt": 0, "spec.algorithm.learningrate": 1})
    assert main(["run", str(bad), "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "spec.algorithm.samplesPerPrompt" in err and "spec.algorithm.learningrate" in err


def test_unsupported_settings_are_refused_before_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _manifest(tmp_path, {"spec.model.lora": {"rank": 4}, "spec.trainer.backend": "megatron"})
    assert main(["run", str(bad), "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "spec.trainer.backend: " in err and "fsdp backend only" in err and "remove model.lora" in err


@pytest.mark.parametrize("transport", ["auto", "broadcast", "disk-delta", "p2p", "cuda-ipc"])
def test_preflight_then_steps_through_each_transport(
    tmp_path: Path, cache: Path, reward_module: str, transport: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every transport after the fixture's SFT warm start: the pre-flight (noise in the engines, first
    update, compare with the warm-started trainer) then two real updates whose logprobs match the
    trainer's. cuda-ipc runs its host shared-memory path on CPU. disk-delta also resumes: its baseline
    is rebuilt from the resumed trainer and the next delta lands on it."""
    from lockstep.weights.preflight import PreflightResult

    edit = {
        "spec.weightSync.transport": transport,
        "spec.weightSync.checkWeightUpdateEqual": True,
        "spec.agent.rewardFunction": f"{reward_module}:by_index",
        "spec.schedule.colocate": transport == "cuda-ipc",  # the API asks cuda-ipc to be colocated
    }
    run_dir = tmp_path / "run"
    args = ["run", str(_manifest(tmp_path, edit)), "--run-dir", str(run_dir), "--cache-dir", str(cache)]
    assert main([*args, "--steps", "2"]) == 0
    result = PreflightResult.model_validate_json((run_dir / "preflight.json").read_text())
    assert result.passed and result.checked_tensors > 0 and not result.mismatches
    assert f"pre-flight passed ({result.message})" in capsys.readouterr().out
    publish = read_jsonl(run_dir / "metrics.jsonl", "update_weights")[0]
    assert publish["preflight_tensors"] == result.checked_tensors  # every tensor compared after noise
    assert publish["preflight_logprob_max_abs_diff"] < 1e-3
    train = read_jsonl(run_dir / "metrics.jsonl", "train")
    assert [r["weight_version"] for r in train] == [1, 2]
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-3 for r in train)  # updates really landed
    if transport == "disk-delta":
        assert 0.0 < train[-1]["update_weights_density"] <= 1.0  # a delta, not a full checkpoint
        assert sorted(p.name for p in (run_dir / "delta").glob("weight_v*")) == [
            "weight_v000001",
            "weight_v000002",
        ]
        assert main([*args, "--steps", "3", "--resume"]) == 0
        (resumed,) = read_jsonl(run_dir / "metrics.jsonl", "train")[2:]
        assert resumed["weight_version"] == 3 and resumed["train_rollout_logprob_abs_diff"] < 1e-3


def test_cuda_ipc_is_refused_without_a_separate_cuda_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    edit = {
        "spec.weightSync.transport": "cuda-ipc",
        "spec.trainer.device": "cuda",
        "spec.schedule.colocate": True,
    }
    assert main(["run", str(_manifest(tmp_path, edit)), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "spec.weightSync.transport: cuda-ipc" in err
    assert "needs a CUDA device" in err or "needs the engine in another process" in err


def test_driver_pod_command_uses_the_given_engine_and_resumes(tmp_path: Path, cache: Path) -> None:
    """`lockstep driver --config job.yaml --engine-url URL`: no engine started; a restart resumes."""
    from lockstep.driver.engines import start_reference_engine
    from lockstep.models import resolve_checkpoint

    server = start_reference_engine(resolve_checkpoint("builtin:tiny", cache_dir=cache))
    try:
        args = ["driver", "--config", str(FIXTURE), "--engine-url", server.url, "--run-dir", str(tmp_path)]
        assert main([*args, "--steps", "1"]) == 0
        assert main([*args, "--steps", "2"]) == 0  # the pod restarted: picks up checkpoints/latest
    finally:
        server.stop()
    train = read_jsonl(tmp_path / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [1, 2]
    assert [r["weight_version"] for r in train] == [1, 2]
    assert len(read_jsonl(tmp_path / "metrics.jsonl", "sft")) == 2  # the warm start ran once


AGENT = """
from lockstep.rollout.session.local import toolcalc_agent

FAMILIES = []

async def recording_agent(ctx, sample):
    FAMILIES.append(ctx.extra.get("family"))
    return await toolcalc_agent(ctx, sample)
"""


def test_builtin_toolcalc_runs_with_the_model_family(tmp_path: Path, cache: Path) -> None:
    """builtin:toolcalc prompts, the TITO toolcalc agent; the agent context carries spec.model.family."""
    (tmp_path / "lockstep_test_agent.py").write_text(textwrap.dedent(AGENT))
    sys.path.insert(0, str(tmp_path))
    try:
        doc = yaml.safe_load((Path(__file__).parents[3] / "examples" / "tiny-tools.yaml").read_text())
        assert doc["spec"]["data"]["prompts"] == "builtin:toolcalc"
        doc["spec"]["agent"]["agentFunction"] = "lockstep_test_agent:recording_agent"
        doc["spec"]["algorithm"] |= {"batchSize": 1, "samplesPerPrompt": 2}
        manifest = tmp_path / "job.yaml"
        manifest.write_text(yaml.safe_dump(doc))
        run_dir = tmp_path / "run"
        args = ["run", str(manifest), "--run-dir", str(run_dir), "--cache-dir", str(cache), "--steps", "1"]
        assert main(args) == 0
        import lockstep_test_agent

        assert lockstep_test_agent.FAMILIES and set(lockstep_test_agent.FAMILIES) == {"tiny"}
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("lockstep_test_agent", None)
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl", "train")] == [1]


@pytest.mark.parametrize("command", ["run", "driver"])
def test_help_lists_the_exit_codes(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "--metrics-port" in out
    for code in ("0 ", "2 ", "3 ", "4 ", "5 ", "130"):
        assert f"\n  {code}" in out, code


def test_a_driver_killed_before_its_first_checkpoint_does_not_warm_start_again(
    tmp_path: Path, cache: Path
) -> None:
    """The warm start ends with a checkpoint (step 0): a driver SIGKILLed during step 1, long before its
    first RL checkpoint, resumes from it. Before, the restart found no checkpoint and ran the warm
    start again on weights that had it already (docs/controlplane.md, the real-pod scenario)."""
    run_dir = tmp_path / "run"
    manifest = _manifest(tmp_path, {"spec.schedule.steps": 200, "spec.schedule.saveInterval": 100})
    lockstep = Path(sys.executable).parent / "lockstep"
    args = ["run", str(manifest), "--run-dir", str(run_dir), "--cache-dir", str(cache)]
    proc = subprocess.Popen([str(lockstep), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (run_dir / "metrics.jsonl").is_file() or not read_jsonl(run_dir / "metrics.jsonl", "train"):
            assert proc.poll() is None, "the first run ended before step 1"
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
    assert _state(run_dir)["extra"] == {
        "step": 0, "version": 0, "prompts_consumed": 0, "next_group_index": 0, "sft_done": True,
    }  # fmt: skip
    assert main([*args, "--steps", "2", "--resume"]) == 0
    assert len(read_jsonl(run_dir / "metrics.jsonl", "sft")) == 2  # the first run's two steps only
    assert _state(run_dir)["extra"]["sft_done"] is True
