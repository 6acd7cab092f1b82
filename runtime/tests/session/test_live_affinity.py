"""Session affinity over engines that come and go (LiveReplicaPool): every turn of a session hits one
engine, read from the engines' own request counters; a session moves only when its engine is gone;
a new engine takes only new sessions. Two real reference engines on 127.0.0.1, the real session
server and HTTP; the membership source is a list the test edits (in a driver pod it is the router
Service's EndpointSlices, e2e/test_session_routing.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from aiohttp import web
from lockstep.rollout.session.affinity import HashRing, place
from lockstep.rollout.session.engine import LiveReplicaPool
from lockstep.rollout.session.server import SessionServer, SessionServerConfig


class _Listed:
    """The engines listed now (what EndpointSliceMembers answers in a cluster)."""

    def __init__(self, urls: list[str]) -> None:
        self.now = list(urls)

    def urls(self) -> list[str]:
        return sorted(self.now)

    def describe(self) -> str:
        return "the test's list"


A, B, C = "http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"


@pytest.mark.parametrize(
    ("pinned", "live", "dp", "moved"),
    [
        (None, [A, B], 1, False),  # a new session: the ring's choice, not a move
        ((A, None), [A, B], 1, False),  # its engine is live: it stays
        ((A, None), [A, B, C], 1, False),  # an engine joined: it still stays
        ((A, None), [B, C], 1, True),  # its engine is gone: it moves, to a live one
        ((A, 1), [A, B], 2, False),  # DP ranks: it stays on its rank too
        ((A, None), [A, B], 2, True),  # a pin without a rank under DP attention is re-placed
    ],
)
def test_place_keeps_a_session_until_its_engine_is_gone(
    pinned: tuple[str, int | None] | None, live: list[str], dp: int, moved: bool
) -> None:
    route, did_move = place("s-1", pinned, HashRing(live, dp_size=dp))
    assert did_move is moved
    assert route[0] in live
    if pinned is not None and not moved:
        assert route == pinned
    assert (route[1] is None) == (dp == 1)


async def _serve(model: Path) -> tuple[web.AppRunner, str]:
    from lockstep.engine.core import ReferenceEngine
    from lockstep.engine.server import create_app

    runner = web.AppRunner(create_app(ReferenceEngine.load(model, context_length=512)), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest_asyncio.fixture
async def two_engines(trained_tiny: Path) -> AsyncIterator[list[tuple[web.AppRunner, str]]]:
    engines = [await _serve(trained_tiny) for _ in range(2)]
    try:
        yield engines
    finally:
        for runner, _ in engines:
            await runner.cleanup()


async def _requests(h: httpx.AsyncClient, urls: list[str]) -> dict[str, int]:
    """Requests each engine has finished, from its own counters (GET /engine_stats)."""
    return {u: (await h.get(f"{u}/engine_stats")).json()["requests"] for u in urls}


async def _session(
    h: httpx.AsyncClient, srv: str, turns: int, history: dict[str, list[dict[str, object]]]
) -> str:
    sid: str = (await h.post(f"{srv}/sessions", json={})).json()["session_id"]
    history[sid] = []
    await _turns(h, srv, sid, turns, history[sid])
    return sid


async def _turns(h: httpx.AsyncClient, srv: str, sid: str, turns: int, msgs: list[dict[str, object]]) -> None:
    for k in range(turns):
        msgs.append({"role": "user", "content": "hi" if k == 0 else "bye"})
        msgs.append(await _reply(h, srv, sid, msgs))


async def _retry(h: httpx.AsyncClient, srv: str, sid: str, msgs: list[dict[str, object]]) -> None:
    """Ask again for the newest reply (a linear session's retry: a turn of the session, on its engine).
    Only the two trained turns are ever asked for: an untrained reply may run to max_tokens, and a
    turn that ended on the budget cannot be extended (409)."""
    msgs[-1] = await _reply(h, srv, sid, msgs[:-1])


async def _reply(
    h: httpx.AsyncClient, srv: str, sid: str, msgs: list[dict[str, object]]
) -> dict[str, object]:
    url = f"{srv}/sessions/{sid}/v1/chat/completions"
    r = await h.post(url, json={"messages": msgs, "max_tokens": 16, "temperature": 0.0})
    assert r.status_code == 200, r.text
    reply: dict[str, object] = r.json()["choices"][0]["message"]
    return reply


async def test_every_turn_of_a_session_hits_one_engine_until_it_is_gone(
    two_engines: list[tuple[web.AppRunner, str]],
) -> None:
    urls = [u for _, u in two_engines]
    listed = _Listed(urls)
    pool = LiveReplicaPool(listed, refresh_s=0.0)
    srv = SessionServer(SessionServerConfig(family="tiny"), pool)
    await srv.start()
    owner: dict[str, str] = {}
    history: dict[str, list[dict[str, object]]] = {}
    try:
        async with httpx.AsyncClient(timeout=60.0) as h:
            # One session at a time (the engines' counters tell who served it), at least 8 and until
            # both engines own one: session ids are random, and 8 land on one engine 1 time in 128.
            while len(owner) < 8 or len(set(owner.values())) < 2:
                assert len(owner) < 64, f"64 sessions, all on one engine: the ring does not spread ({owner})"
                before = await _requests(h, urls)
                sid = await _session(h, srv.url, 2, history)
                after = await _requests(h, urls)
                served = {u: after[u] - before[u] for u in urls}
                assert sorted(served.values()) == [0, 2], served  # both turns on one engine
                owner[sid] = next(u for u in urls if served[u])
            assert set(owner.values()) == set(urls)  # and sessions spread over both
            assert pool.moved == 0

            # the first engine leaves the list (its pod deleted); its sessions move, the others stay
            gone, kept = urls
            listed.now = [kept]
            before = await _requests(h, urls)
            for sid in owner:
                await _retry(h, srv.url, sid, history[sid])
            after = await _requests(h, urls)
            assert after[gone] == before[gone]
            assert after[kept] - before[kept] == len(owner)
            assert pool.moved == sum(1 for u in owner.values() if u == gone)

            # it comes back: the moved sessions stay where they are now (no second move)
            listed.now = urls
            moved = pool.moved
            before = await _requests(h, urls)
            for sid in owner:
                await _retry(h, srv.url, sid, history[sid])
            after = await _requests(h, urls)
            assert after[gone] == before[gone] and pool.moved == moved
    finally:
        await srv.stop()
        await pool.aclose()


async def test_a_turn_whose_engine_died_goes_to_a_live_one(
    two_engines: list[tuple[web.AppRunner, str]],
) -> None:
    urls = [u for _, u in two_engines]
    listed = _Listed(urls)
    pool = LiveReplicaPool(listed, refresh_s=3600.0)  # only a failed turn makes it ask again
    srv = SessionServer(SessionServerConfig(family="tiny"), pool)
    await srv.start()
    history: dict[str, list[dict[str, object]]] = {}
    try:
        async with httpx.AsyncClient(timeout=60.0) as h:
            sids = [await _session(h, srv.url, 1, history) for _ in range(6)]
            victim = pool.turns.most_common(1)[0][0]
            await two_engines[urls.index(victim)][0].cleanup()  # the engine dies
            listed.now = [u for u in urls if u != victim]  # and leaves the Service
            for sid in sids:
                await _turns(h, srv.url, sid, 1, history[sid])  # every turn still answers
            assert pool.moved >= 1
    finally:
        await srv.stop()
        await pool.aclose()
