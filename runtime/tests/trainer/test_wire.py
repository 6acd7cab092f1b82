"""The driver <-> trainer wire: RemoteTrainer against the real command server on 127.0.0.1.

The server side runs a small Trainer (the protocol is the swap point) that records what arrives and
fails on demand, so the semantics the driver relies on are checked without a model: groups arrive
token-exact (every field the loss needs, per-token versions included), trainer-side errors come back
as the driver's own exceptions (NonFiniteLoss -> exit 4, PreflightFailed -> exit 5, ValueError -> exit
2), a weight update that lost an engine is repeated a few times, then EngineGone; a command while
another runs is a 409, and an unreachable trainer is retried with backoff, then TrainerUnreachable.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from lockstep.driver.remote import (
    EngineGone,
    RemoteTrainer,
    TrainerCommandError,
    TrainerUnreachable,
    engine_retry_delays,
)
from lockstep.serving.client import EngineUnreachable
from lockstep.trainer.protocol import NonFiniteLoss, PreflightFailed
from lockstep.trainer.server import CommandServer, _serve_http
from lockstep.trainer.state import DriverState
from lockstep.trainer.wire import API_PREFIX, GroupWire
from lockstep.types import Group, Sample, SampleStatus
from lockstep.weights.preflight import PreflightResult, TensorMismatch


class ScriptedTrainer:
    """A Trainer that records its calls and raises what the test asks for."""

    def __init__(self) -> None:
        self.groups: list[Group] = []
        self.saved: list[DriverState] = []
        self.fail: dict[str, Exception] = {}
        self.release = threading.Event()
        self.preflight: PreflightResult | None = None
        self.lost_engine = 0
        """update_weights raises EngineUnreachable this many more times."""

    def _maybe_fail(self, name: str) -> None:
        if name in self.fail:
            raise self.fail[name]

    def warm_start(self) -> Iterator[dict[str, float]]:
        yield {"loss": 2.0}
        yield {"loss": 1.0}

    def first_update(self, version: int) -> dict[str, float]:
        self._maybe_fail("first_update")
        return {"weight_version": float(version)}

    def preflight_result(self) -> PreflightResult | None:
        return self.preflight

    def train(self, groups: list[Group]) -> dict[str, float]:
        self._maybe_fail("train")
        self.groups = groups
        return {"loss": 0.5}

    def update_weights(self, version: int) -> dict[str, float]:
        if self.lost_engine > 0:  # an engine the update had reached stops answering (scaled down)
            self.lost_engine -= 1
            raise EngineUnreachable("http://10.0.0.9:30000/continue_generation", 5, OSError("refused"))
        self.release.wait(30)
        return {"weight_version": float(version)}

    def save(self, state: DriverState) -> str:
        self._maybe_fail("save")
        self.saved.append(state)
        return f"/ckpt/step_{state.step:06d}"

    def load_latest(self) -> DriverState | None:
        return self.saved[-1] if self.saved else None

    def where(self) -> str:
        return "/ckpt"

    def shutdown(self) -> None: ...

    def close(self) -> None: ...


@pytest.fixture
def served() -> Iterator[tuple[ScriptedTrainer, str]]:
    trainer = ScriptedTrainer()
    server = CommandServer(trainer, "job-a", world_size=2)
    port: list[int] = []
    listening = threading.Event()

    def ready(p: int) -> None:
        port.append(p)
        listening.set()

    thread = threading.Thread(target=lambda: asyncio.run(_serve_http(server, "127.0.0.1", 0, ready)))
    thread.start()
    assert listening.wait(30)
    url = f"http://127.0.0.1:{port[0]}"
    try:
        yield trainer, url
    finally:
        trainer.release.set()
        httpx.post(f"{url}/v2/shutdown", json={})
        thread.join(30)


def _groups() -> list[Group]:
    s0 = Sample(7, 0, [1, 2, 3], [4, 5, 6], [1, 0, 1], [-0.5, 0.0, -1.25], [3, None, 4], reward=1.0)
    s1 = Sample(7, 1, [1, 2, 3], [9], [1], [-2.0], [4], reward=0.0, status=SampleStatus.TRUNCATED,
                routed_experts=b"\x00\x01\xff", label="teacher")  # fmt: skip
    return [Group(7, [s0, s1])]


def test_commands_round_trip_token_exact(served: tuple[ScriptedTrainer, str]) -> None:
    trainer, url = served
    remote = RemoteTrainer(url)
    try:
        assert remote.wait_ready("job-a", timeout_s=10).world_size == 2
        assert list(remote.warm_start()) == [{"loss": 2.0}, {"loss": 1.0}]
        assert remote.first_update(0) == {"weight_version": 0.0}
        assert remote.train(_groups()) == {"loss": 0.5}
        assert trainer.groups == _groups()  # every field the loss and staleness read, per token
        assert remote.load_latest() is None
        state = DriverState(step=4, version=3, prompts_consumed=8, next_group_index=9, sft_done=True)
        state.pending_groups = [[7, 6]]  # fully-async: the groups to regenerate and the buffer's counts
        state.group_counts = {"consumed_groups": 8, "stale_groups_filtered": 1}
        assert remote.save(state) == "/ckpt/step_000004"
        assert remote.load_latest() == state
        with pytest.raises(ValueError, match="serves job 'job-a', not 'job-b'"):
            remote.wait_ready("job-b", timeout_s=10)
    finally:
        remote.close()


def test_trainer_errors_come_back_as_the_drivers_exceptions(served: tuple[ScriptedTrainer, str]) -> None:
    trainer, url = served
    remote = RemoteTrainer(url)
    trainer.fail = {
        "train": NonFiniteLoss("non-finite loss (nan); the step was not applied"),
        "first_update": PreflightFailed("spec.weightSync.checkWeightUpdateEqual: 2 tensors differ"),
        "save": ValueError("spec.schedule.saveInterval: broken"),
    }
    try:
        with pytest.raises(NonFiniteLoss, match=r"non-finite loss \(nan\)"):
            remote.train(_groups())
        with pytest.raises(PreflightFailed, match="2 tensors differ"):
            remote.first_update(0)
        with pytest.raises(ValueError, match="saveInterval: broken"):
            remote.save(DriverState())
        trainer.fail["train"] = RuntimeError("CUDA out of memory")
        with pytest.raises(TrainerCommandError, match="train: internal: RuntimeError: CUDA out of memory"):
            remote.train(_groups())
    finally:
        remote.close()


def test_one_command_at_a_time(served: tuple[ScriptedTrainer, str]) -> None:
    trainer, url = served
    updated: list[dict[str, float]] = []
    first = threading.Thread(target=lambda: updated.append(RemoteTrainer(url).update_weights(5)))
    first.start()
    for _ in range(600):  # until the update is running on the trainer
        if httpx.get(f"{url}/v2/health").json()["busy"] == "update_weights":
            break
        threading.Event().wait(0.01)
    r = httpx.post(f"{url}/v2/update_weights", json={"version": 6})
    assert (
        r.status_code == 409
        and r.json()["kind"] == "busy"
        and "'update_weights' is running" in r.json()["message"]
    )
    # A restarted driver waits for the command of its predecessor to end before it attaches.
    second = RemoteTrainer(url)
    with pytest.raises(TrainerUnreachable, match="not ready within 0 s"):
        second.wait_ready("job-a", timeout_s=0.2, poll_s=0.1)
    trainer.release.set()
    first.join(30)
    assert updated == [{"weight_version": 5.0}]
    assert second.wait_ready("job-a", timeout_s=10).busy is None
    second.close()


def test_unreachable_trainer_is_retried_with_backoff_then_fails_clearly() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: connection refused
        slept: list[float] = []
        remote = RemoteTrainer(url, retries=4, backoff_s=0.25, sleep=slept.append)
        with pytest.raises(TrainerUnreachable, match="unreachable after 4 attempts") as e:
            remote.update_weights(1)
        remote.close()
    assert slept == [0.25, 0.5, 1.0]
    assert f"trainer at {url}" in str(e.value) and "LOCKSTEP_TRAINER_URL" in str(e.value)


def test_a_restarted_trainer_group_refuses_the_old_drivers_commands(
    served: tuple[ScriptedTrainer, str],
) -> None:
    _, url = served
    remote = RemoteTrainer(url)
    try:
        remote.wait_ready("job-a", timeout_s=10)
        assert remote.first_update(0) == {"weight_version": 0.0}
        remote.instance = "0" * 32  # what the driver saw before the group restarted at the same URL
        with pytest.raises(TrainerUnreachable, match="started again") as e:
            remote.train(_groups())
        assert "restart the driver to resume" in str(e.value)
    finally:
        remote.close()


def test_values_the_loss_cannot_use_are_refused_at_the_wire(served: tuple[ScriptedTrainer, str]) -> None:
    """A NaN reward or a non-finite logprob never reaches the trainer: the wire model refuses it on
    the driver's side (naming the field), and the server answers 400 to a client that sends it anyway
    (JSON carries it as NaN, never as null, which would turn it into "no reward"). Nothing trains. The
    driver stops on a non-finite reward before this (lockstep.driver.batch_checks, exit 4)."""
    trainer, url = served
    good = GroupWire.of(_groups()[0]).model_dump(mode="json")
    for field, needle in (("reward", "reward nan"), ("rollout_logprobs", "rollout_logprobs holds -inf")):
        groups = _groups()
        if field == "reward":
            groups[0].samples[0].reward = float("nan")
        else:
            groups[0].samples[0].rollout_logprobs = [float("-inf")] * len(groups[0].samples[0].response_ids)
        remote = RemoteTrainer(url)
        try:
            with pytest.raises(ValueError, match=needle):
                remote.train(groups)
        finally:
            remote.close()
        body = json.loads(json.dumps({"groups": [good]}))
        sample = body["groups"][0]["samples"][0]
        sample[field] = "@" if field == "reward" else ["@"] * len(sample["response_ids"])
        raw = json.dumps(body).replace('"@"', "NaN" if field == "reward" else "-Infinity")
        r = httpx.post(f"{url}{API_PREFIX}/train", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and needle.split()[0] in r.json()["message"], r.text
    assert trainer.groups == []


def test_the_trainers_preflight_result_reaches_the_drivers_run_dir(
    served: tuple[ScriptedTrainer, str], tmp_path: Path
) -> None:
    """The progress channel reads preflight.json from the driver's run dir, as with a local trainer."""
    from lockstep.weights.preflight import PREFLIGHT_FILE

    trainer, url = served
    remote = RemoteTrainer(url, run_dir=tmp_path)
    written = tmp_path / PREFLIGHT_FILE
    try:
        trainer.preflight = PreflightResult(
            passed=True, engines=1, checked_tensors=24, message="24 tensors equal"
        )
        remote.first_update(0)
        assert PreflightResult.model_validate_json(written.read_text()) == trainer.preflight
        trainer.preflight = None  # a start without the check: an earlier result is not this one's
        remote.first_update(0)
        assert not written.exists()
        bad = PreflightResult(
            passed=False,
            engines=1,
            checked_tensors=24,
            mismatches=[TensorMismatch(engine="http://e:1", name="model.norm.weight", reason="checksum")],
            message="1 tensors differ after the first update: model.norm.weight",
        )
        trainer.fail["first_update"] = PreflightFailed("spec.weightSync.checkWeightUpdateEqual: differ", bad)
        with pytest.raises(PreflightFailed) as e:
            remote.first_update(0)
        assert e.value.result == bad
        assert PreflightResult.model_validate_json(written.read_text()) == bad
    finally:
        remote.close()


@pytest.mark.parametrize(
    ("retries", "first_s", "delays"),
    [(4, 5.0, [5.0, 10.0, 20.0, 40.0]), (1, 2.0, [2.0]), (0, 5.0, []), (-1, 5.0, [])],
)
def test_engine_retry_delays(retries: int, first_s: float, delays: list[float]) -> None:
    assert engine_retry_delays(retries, first_s) == delays


def test_an_update_that_lost_an_engine_is_repeated_then_fails_naming_it(
    served: tuple[ScriptedTrainer, str],
) -> None:
    """A scaled-down engine stays listed until its pod is gone: the update is sent again (same version)
    a little later and then reaches only the engines still there; one that never comes back fails it."""
    trainer, url = served
    trainer.release.set()
    waited: list[float] = []
    remote = RemoteTrainer(url, sleep=waited.append, engine_retries=3, engine_retry_s=1.0)
    try:
        trainer.lost_engine = 2
        assert remote.update_weights(7) == {"weight_version": 7.0}
        assert waited == [1.0, 2.0] and trainer.lost_engine == 0
        trainer.lost_engine, waited[:] = 10, []
        with pytest.raises(
            EngineGone, match=r"update_weights: rollout engine at http://10.0.0.9:30000/continue"
        ):
            remote.update_weights(8)
        assert waited == [1.0, 2.0, 4.0]  # four attempts, then the error
        assert isinstance(EngineGone("x"), TrainerCommandError)  # the driver's exit code is unchanged
    finally:
        remote.close()
