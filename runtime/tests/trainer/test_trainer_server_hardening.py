"""The trainer command server's HTTP boundary under hostile input (rank 0's aiohttp app on 127.0.0.1).

The trainer behind it is a recorder of the commands that reached it: each row of the table asserts
its status, that no command ran (the trainer's state is unchanged) and that the server still takes
a valid command. Without the job's key every command is 401 (health stays open); bodies are capped.
The whole server with real ranks is exercised by runtime/tests/driver/test_remote_trainer.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest_asyncio
from aiohttp.test_utils import TestServer
from lockstep.trainer.server import CommandServer
from lockstep.trainer.state import DriverState
from lockstep.trainer.wire import API_PREFIX, INSTANCE_HEADER

KEY = "trainer-test-key"


class _Recorder:
    """A ServedTrainer that records every call (the state a hostile request must not change)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def warm_start(self) -> Iterator[dict[str, float]]:
        self.calls.append(("warm_start", None))
        return iter(())

    def first_update(self, version: int) -> dict[str, float]:
        self.calls.append(("first_update", version))
        return {}

    def train(self, groups: list[Any]) -> dict[str, float]:
        self.calls.append(("train", len(groups)))
        return {"loss": 0.0}

    def update_weights(self, version: int) -> dict[str, float]:
        self.calls.append(("update_weights", version))
        return {}

    def save(self, state: DriverState) -> str:
        self.calls.append(("save", state.step))
        return "/ckpt"

    def load_latest(self) -> DriverState | None:
        self.calls.append(("load_latest", None))
        return None

    def preflight_result(self) -> None:
        return None

    def where(self) -> str:
        return "/ckpt"


@pytest_asyncio.fixture
async def served() -> AsyncIterator[tuple[CommandServer, _Recorder, str]]:
    trainer = _Recorder()
    server = CommandServer(trainer, "job", 1, api_key=KEY, max_body_bytes=1 << 20, vocab_size=VOCAB)  # type: ignore[arg-type]
    test = TestServer(server.app(), host="127.0.0.1")
    await test.start_server()
    try:
        yield server, trainer, str(test.make_url("")).rstrip("/")
    finally:
        await test.close()
        server.pool.shutdown(wait=True)


def _nested(depth: int) -> bytes:
    return b'{"version": ' + b"[" * depth + b"]" * depth + b"}"


VOCAB = 64
_SAMPLE = {
    "group_index": 0, "index": 0, "prompt_ids": [1, 2], "response_ids": [3, 4], "loss_mask": [1, 1],
    "rollout_logprobs": [-0.5, -0.25], "token_versions": [0, 0], "reward": 1.0,
}  # fmt: skip


def _train(**sample: Any) -> Any:
    """A train body of one group with one sample (`sample` overrides its fields)."""
    return {"groups": [{"index": 0, "samples": [{**_SAMPLE, **sample}]}]}


def _raw(field: str, text: bytes) -> bytes:
    """A train body whose `field` is the raw JSON `text` (NaN and Infinity have no strict JSON spelling)."""
    return json.dumps(_train(**{field: "@"})).encode().replace(b'"@"', text)


ROWS: list[tuple[str, str, Any, dict[str, str] | None, int]] = [
    # (row, command, body, headers (None: the key), status)
    ("no key", "update_weights", {"version": 1}, {}, 401),
    ("wrong key", "update_weights", {"version": 1}, {"Authorization": "Bearer wrong"}, 401),
    ("key without Bearer", "save", {"state": {}}, {"Authorization": KEY}, 401),
    ("shutdown without key", "shutdown", {}, {}, 401),
    ("unknown command without key", "format_disk", {}, {}, 401),
    ("negative version", "update_weights", {"version": -1}, None, 400),
    ("version 2**70", "update_weights", {"version": 2**70}, None, 400),
    ("version as text", "first_update", {"version": "1; rm -rf /"}, None, 400),
    ("extra field", "update_weights", {"version": 1, "evil": True}, None, 400),
    ("empty train", "train", {"groups": []}, None, 400),
    ("nested JSON 100k", "update_weights", _nested(100_000), None, 400),
    ("not JSON", "update_weights", b"\xff{", None, 400),
    ("body 2 MiB", "train", b'{"groups": [' + b"1," * (1 << 20) + b"1]}", None, 413),
    ("unknown command", "format_disk", {}, None, 404),
    # values the loss cannot use: refused before any state changes (1e308 used to apply the step,
    # then fail with a 500; -1 in the mask trained the token; an ID outside the vocabulary was a 500)
    ("reward 1e308", "train", _train(reward=1e308), None, 400),
    ("reward -1e308", "train", _train(reward=-1e308), None, 400),
    ("reward NaN", "train", _raw("reward", b"NaN"), None, 400),
    ("reward Infinity", "train", _raw("reward", b"Infinity"), None, 400),
    ("loss_mask -1", "train", _train(loss_mask=[1, -1]), None, 400),
    ("loss_mask 2", "train", _train(loss_mask=[2, 1]), None, 400),
    ("token outside the vocabulary", "train", _train(response_ids=[3, VOCAB]), None, 400),
    ("negative prompt token", "train", _train(prompt_ids=[-1, 2]), None, 400),
    ("logprob NaN", "train", _raw("rollout_logprobs", b"[NaN, -0.1]"), None, 400),
    ("version -1", "train", _train(token_versions=[0, -1]), None, 400),
    (
        "a restarted group",
        "update_weights",
        {"version": 1},
        {INSTANCE_HEADER: "old", "Authorization": f"Bearer {KEY}"},
        409,
    ),
]


async def test_hostile_input_table(served: tuple[CommandServer, _Recorder, str]) -> None:
    server, trainer, url = served
    auth = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for row, command, body, headers, status in ROWS:
            kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = await http.post(f"{API_PREFIX}/{command}", headers=auth if headers is None else headers, **kw)
            assert r.status_code == status, f"{row}: {r.status_code} {r.text[:300]}"
            assert KEY not in r.text, row
            assert trainer.calls == [], f"{row}: a command ran: {trainer.calls}"
            health = await http.get(f"{API_PREFIX}/health")  # open, and the server is not wedged
            assert health.status_code == 200 and health.json()["busy"] is None, row
            assert not server.done.is_set(), row
        ok = await http.post(f"{API_PREFIX}/update_weights", json={"version": 3}, headers=auth)
        assert ok.status_code == 200, ok.text
        trained = await http.post(f"{API_PREFIX}/train", json=_train(), headers=auth)
        assert trained.status_code == 200, trained.text  # the template itself is valid
    assert trainer.calls == [("update_weights", 3), ("train", 1)]


async def test_commands_are_counted_and_timed_for_prometheus(
    served: tuple[CommandServer, _Recorder, str],
) -> None:
    """The trainer's series (lockstep.trainer.telemetry) over a real endpoint: a refused command is not
    counted, a run one is (ok) with its duration, and readiness follows the server's state."""
    from lockstep.observability.metrics import serve_registry
    from lockstep.trainer import telemetry
    from prometheus_client.parser import text_string_to_metric_families

    server, _, url = served
    port = serve_registry(telemetry.REGISTRY, 0, "127.0.0.1")

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    ok_key = ("lockstep_trainer_commands_total", (("command", "update_weights"), ("result", "ok")))
    count_key = ("lockstep_trainer_command_seconds_count", (("command", "update_weights"),))
    before = scrape()
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        assert (await http.post(f"{API_PREFIX}/update_weights", json={"version": 2})).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        r = await http.post(f"{API_PREFIX}/update_weights", json={"version": 2}, headers=auth)
        assert r.status_code == 200, r.text
    after = scrape()
    assert after[ok_key] == before.get(ok_key, 0.0) + 1
    assert after[count_key] == before.get(count_key, 0.0) + 1
    assert after[("lockstep_trainer_ready", ())] == 1.0
    server.draining = True
    assert scrape()[("lockstep_trainer_ready", ())] == 0.0
