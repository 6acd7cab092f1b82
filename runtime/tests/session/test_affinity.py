"""Session affinity: consistent hashing of session ids, and the sgl-router routing header on the wire."""

from __future__ import annotations

import httpx
import pytest
from aiohttp import web
from lockstep.rollout.session.affinity import ROUTING_HEADER, HashRing
from lockstep.rollout.session.engine import ReplicaPool
from lockstep.rollout.session.server import SessionServer, SessionServerConfig


def test_ring_is_sticky_balanced_and_moves_few_sessions() -> None:
    replicas = [f"http://10.0.0.{i}:30000" for i in range(4)]
    ring = HashRing(replicas)
    ids = [f"session-{i}" for i in range(2000)]
    owners = {s: ring.pick(s) for s in ids}
    assert all(ring.pick(s) == owners[s] for s in ids)  # every turn of a session: the same replica
    counts = [list(owners.values()).count(r) for r in replicas]
    assert min(counts) > 2000 / 4 * 0.5  # no replica starves
    smaller = HashRing(replicas[:3])
    moved = sum(1 for s in ids if owners[s] != replicas[3] and smaller.pick(s) != owners[s])
    assert moved == 0  # removing a replica moves only the sessions it owned


def test_dp_ring_spreads_sessions_over_every_rank_and_is_sticky() -> None:
    replicas = [f"http://10.0.0.{i}:30000" for i in range(2)]
    ring = HashRing(replicas, dp_size=4)
    ids = [f"session-{i}" for i in range(2000)]
    routes = {s: ring.route(s) for s in ids}
    assert all(ring.route(s) == routes[s] for s in ids)
    assert set(routes.values()) == {(r, k) for r in replicas for k in range(4)}
    assert HashRing(replicas).route("session-0")[1] is None  # one rank: the engine chooses
    with pytest.raises(ValueError, match="dp_size=0"):
        HashRing(replicas, dp_size=0)


@pytest.mark.parametrize("dp_size", [1, 2])
async def test_every_turn_carries_the_session_id_as_routing_key(engine_url: str, dp_size: int) -> None:
    """A forwarding stand-in for sgl-router (and, with dp_size 2, for SGLang's DP dispatcher in front
    of the one-rank reference engine) records what each turn carries, then forwards to the real engine."""
    seen: list[tuple[str | None, int | None]] = []
    http = httpx.AsyncClient()

    async def route(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.headers.get(ROUTING_HEADER), body.get("routed_dp_rank")))
        if "routed_dp_rank" in body:
            body["routed_dp_rank"] = 0  # the rank's scheduler: the engine behind has one rank
        r = await http.post(engine_url + "/generate", json=body)
        return web.Response(body=r.content, status=r.status_code, content_type="application/json")

    app = web.Application()
    app.router.add_post("/generate", route)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    router_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    pool = ReplicaPool([router_url], dp_size=dp_size)
    srv = SessionServer(SessionServerConfig(family="tiny", temperature=0.0), pool)
    await srv.start()
    try:
        async with httpx.AsyncClient() as h:
            sid = (await h.post(f"{srv.url}/sessions", json={})).json()["session_id"]
            url = f"{srv.url}/sessions/{sid}/v1/chat/completions"
            hi = {"role": "user", "content": "hi"}
            r1 = (await h.post(url, json={"messages": [hi]})).json()
            reply = r1["choices"][0]["message"]
            r2 = await h.post(url, json={"messages": [hi, reply, {"role": "user", "content": "bye"}]})
            assert r2.status_code == 200, r2.text
    finally:
        await srv.stop()
        await runner.cleanup()
        await http.aclose()
    rank = pool.ring.route(sid)[1]
    assert (rank is None) == (dp_size == 1)
    assert seen == [(sid, rank), (sid, rank)]


async def test_idle_sessions_are_swept_on_create() -> None:
    now = [1000.0]
    unused_engine = ReplicaPool(["http://127.0.0.1:9"])  # no turn is generated in this test
    srv = SessionServer(
        SessionServerConfig(family="tiny", idle_ttl_s=60), unused_engine, clock=lambda: now[0]
    )
    await srv.start()
    try:
        async with httpx.AsyncClient() as h:
            old = (await h.post(f"{srv.url}/sessions", json={})).json()["session_id"]
            now[0] += 30
            kept = (await h.post(f"{srv.url}/sessions", json={})).json()["session_id"]
            now[0] += 45  # old is idle 75 s, kept 45 s
            await h.post(f"{srv.url}/sessions", json={})
            assert (await h.get(f"{srv.url}/sessions/{old}")).status_code == 404
            assert (await h.get(f"{srv.url}/sessions/{kept}")).status_code == 200
    finally:
        await srv.stop()
