"""The Coalescer: one pass per object at a time, kicks during a pass fold into one more, errors retry."""

from __future__ import annotations

import asyncio

from lockstep_operator.handlers import Coalescer, Key

KEY: Key = ("RLJob", "ns", "a")


async def test_kicks_during_a_pass_cause_exactly_one_more() -> None:
    started, release, runs = asyncio.Event(), asyncio.Event(), []

    async def run(key: Key) -> None:
        runs.append(key)
        started.set()
        await release.wait()

    c = Coalescer(run)
    c.kick(KEY)
    await started.wait()
    for _ in range(5):
        c.kick(KEY)  # arrive while the first pass runs
    c.kick(("RLJob", "ns", "b"))  # another object runs in parallel
    release.set()
    while c._tasks:
        await asyncio.sleep(0.01)
    assert runs.count(KEY) == 2 and runs.count(("RLJob", "ns", "b")) == 1


async def test_a_failed_pass_is_retried() -> None:
    calls = []

    async def run(key: Key) -> None:
        calls.append(key)
        if len(calls) == 1:
            raise RuntimeError("apiserver hiccup")

    c = Coalescer(run, max_backoff_s=0.01)
    c.kick(KEY)
    while c._tasks:
        await asyncio.sleep(0.01)
    assert len(calls) == 2
