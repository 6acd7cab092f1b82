"""Rank 0 on SIGTERM checkpoints the steps trained since the driver's last save (preemption).

The driver sends, with every train command, its state once that step is done (TrainRequest.state); the
command server keeps the latest one no save has covered. On SIGTERM (drain) it lets the running command
finish, then saves with that state before exiting, so a deleted rank pod or a drained trainer node loses
no step: the restarted gang resumes from it. Here the real server (aiohttp on 127.0.0.1) runs over a
trainer that records its calls; the whole path with real ranks and a real driver is in
runtime/tests/driver/test_remote_trainer.py. The server also records why it stopped serving (`ending`),
which rank 0 tells the followers and which sets every rank's exit code (test_rank_exit.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
from aiohttp.test_utils import TestServer
from lockstep.trainer.server import CommandServer
from lockstep.trainer.state import DriverState
from lockstep.trainer.wire import API_PREFIX


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def train(self, groups: list[Any]) -> dict[str, float]:
        self.calls.append(("train", len(groups)))
        return {"loss": 0.0}

    def save(self, state: DriverState) -> str:
        self.calls.append(("save", state.step))
        return f"/ckpt/step_{state.step}"

    def warm_start(self) -> Iterator[dict[str, float]]:
        return iter(())

    def update_weights(self, version: int) -> dict[str, float]:
        self.calls.append(("update_weights", version))
        return {}


SAMPLE = {
    "group_index": 0, "index": 0, "prompt_ids": [1, 2], "response_ids": [3], "loss_mask": [1],
    "rollout_logprobs": [-0.5], "token_versions": [0], "reward": 1.0,
}  # fmt: skip


def _state(step: int) -> dict[str, Any]:
    return {"step": step, "version": step, "prompts_consumed": 2 * step, "next_group_index": 2 * step,
            "sft_done": True, "pending_groups": [[2 * step, 2 * step]],
            "group_counts": {"consumed_groups": 2 * step, "stale_groups_filtered": 0}}  # fmt: skip


async def _serve(trainer: _Recorder) -> tuple[CommandServer, TestServer, str]:
    server = CommandServer(trainer, "job", 1)  # type: ignore[arg-type]
    test = TestServer(server.app(), host="127.0.0.1")
    await test.start_server()
    return server, test, str(test.make_url("")).rstrip("/")


async def test_sigterm_checkpoints_the_steps_trained_since_the_last_save() -> None:
    trainer = _Recorder()
    server, test, url = await _serve(trainer)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {"groups": [{"index": 0, "samples": [SAMPLE]}]}
            for step in (1, 2):
                r = await http.post(f"{API_PREFIX}/train", json={**body, "state": _state(step)})
                assert r.status_code == 200, r.text
            assert (await http.post(f"{API_PREFIX}/save", json={"state": _state(2)})).status_code == 200
            r = await http.post(f"{API_PREFIX}/train", json={**body, "state": _state(3)})
            assert r.status_code == 200
            server.drain(10.0)  # what SIGTERM does
            await asyncio.wait_for(server.done.wait(), 30)
            refused = await http.post(f"{API_PREFIX}/train", json=body)
            assert refused.status_code == 503 and refused.json()["kind"] == "draining"
        assert trainer.calls == [("train", 1), ("train", 1), ("save", 2), ("train", 1), ("save", 3)]
        assert server.ending == "sigterm"  # rank 0's own SIGTERM: a requested stop, not the job's end
    finally:
        await test.close()
        server.pool.shutdown(wait=True)


async def test_sigterm_after_a_save_writes_nothing_more() -> None:
    trainer = _Recorder()
    server, test, url = await _serve(trainer)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {"groups": [{"index": 0, "samples": [SAMPLE]}], "state": _state(1)}
            assert (await http.post(f"{API_PREFIX}/train", json=body)).status_code == 200
            assert (await http.post(f"{API_PREFIX}/save", json={"state": _state(1)})).status_code == 200
        server.drain(10.0)
        await asyncio.wait_for(server.done.wait(), 30)
        assert trainer.calls == [("train", 1), ("save", 1)]
    finally:
        await test.close()
        server.pool.shutdown(wait=True)


async def test_a_followers_sigterm_drains_as_peer_and_the_drivers_shutdown_as_shutdown() -> None:
    trainer = _Recorder()
    server, test, url = await _serve(trainer)
    try:
        server.drain(10.0, "peer")  # what a follower's notice does (preempt_notice.watch)
        await asyncio.wait_for(server.done.wait(), 30)
        server.drain(10.0)  # rank 0's own SIGTERM after: the first cause stays
        assert server.ending == "peer"
    finally:
        await test.close()
        server.pool.shutdown(wait=True)
    server, test, url = await _serve(_Recorder())
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            assert (await http.post(f"{API_PREFIX}/shutdown", json={})).status_code == 200
        await asyncio.wait_for(server.done.wait(), 30)
        assert server.ending == "shutdown"
    finally:
        await test.close()
        server.pool.shutdown(wait=True)
