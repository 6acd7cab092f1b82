"""Prefix-cache hit ratio of agent sessions over 2 engines: the driver's session routing (LiveReplicaPool
over the router Service's endpoints) vs the Service's own spread of turns (round robin), read from the
engines (GET /engine_stats: cached / prompt tokens).

Why it exists: in a cluster the driver used to send every turn through the pool's ClusterIP Service,
whose load balancing scatters a session's turns over the engines, so each turn re-prefilled its whole
history on an engine that had not seen it. docs/tito.md ("Affinity") says how sessions are routed now.

Baseline in the same run: the same sessions, turns and engines with every turn sent to the next
engine (what kube-proxy's spread does to a session, in expectation for 2 engines). A third pass
removes one engine from the list once every session has had half its turns (its pod gone): its
sessions move once (one cold prefill each) and hit the other engine's cache from then on.

Run: .venv/bin/python bench/session_routing.py [--sessions 16] [--turns 8] [--json PATH]
     [--endpointslices]  (list the engines through a real API server's EndpointSlices: starts the
     control plane, e2e/controlplane; without it the list is given directly)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.tito_overhead import RoundRobin, assistant_dict  # noqa: E402


class Listed:
    """The engines listed now (the router Service's ready endpoints, without a cluster)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.now = list(urls)

    def urls(self) -> list[str]:
        return sorted(self.now)

    def describe(self) -> str:
        return "the bench's list"


async def _engines(n: int, host: str) -> tuple[list[Any], list[str]]:
    from aiohttp import web
    from lockstep.engine.core import ReferenceEngine
    from lockstep.engine.server import create_app
    from lockstep.models.tiny import materialize_builtin

    ckpt = materialize_builtin("builtin:tiny", Path("/tmp/lockstep-bench-tiny"), seed=0)
    runners, urls = [], []
    for _ in range(n):
        runner = web.AppRunner(
            create_app(ReferenceEngine.load(ckpt, max_running_requests=8)), access_log=None
        )
        await runner.setup()
        await web.TCPSite(runner, host, 0).start()
        runners.append(runner)
        urls.append(f"http://{host}:{runner.addresses[0][1]}")
    return runners, urls


async def _stats(urls: Sequence[str]) -> dict[str, tuple[int, int]]:
    async with httpx.AsyncClient() as h:
        out = {}
        for u in urls:
            s = (await h.get(f"{u}/engine_stats")).json()
            out[u] = (int(s["prompt_tokens"]), int(s["cached_tokens"]))
        return out


async def _session(h: httpx.AsyncClient, base: str, i: int, turns: int, halfway: Any) -> None:
    """One session (as bench/tito_overhead.py's figure 3: random tiny model, short turns ended by
    single-character stops); `halfway`, when given, is awaited before the second half of its turns."""
    sid = (await h.post(f"{base}/sessions", json={})).json()["session_id"]
    url = f"{base}/sessions/{sid}/v1/chat/completions"
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"session {i} says hello"}]
    for t in range(turns):
        if halfway is not None and t == turns // 2:
            await halfway()
        body = {"messages": messages, "max_tokens": 24, "seed": i * 100 + t, "stop": list("aeiou tnsr")}
        r = await h.post(url, json=body)
        if r.status_code != 200:  # a length-truncated turn cannot be extended: the session ends there
            if halfway is not None and t < turns // 2:
                await halfway()  # the others wait for every session at the halfway point
            return
        messages.append(assistant_dict(r.json()))
        messages.append({"role": "user", "content": f"turn {t} next"})


async def _pass(
    engine: Any, urls: Sequence[str], sessions: int, turns: int, offset: int, drop: Any = None
) -> dict[str, Any]:
    """Run `sessions` concurrent sessions through a session server on `engine`; the engines' ratio.
    With `drop`: once every session has had half its turns, drop() (an engine leaves), then the rest."""
    from lockstep.rollout.session.server import SessionServer, SessionServerConfig

    halfway = None
    if drop is not None:
        arrived, released = asyncio.Barrier(sessions), asyncio.Barrier(sessions)

        async def halfway() -> None:
            if await arrived.wait() == 0:
                drop()
            await released.wait()

    before = await _stats(urls)
    srv = SessionServer(SessionServerConfig(family="tiny", max_new_tokens=24), engine)
    await srv.start()
    try:
        async with httpx.AsyncClient(timeout=600) as h:
            await asyncio.gather(*(_session(h, srv.url, offset + i, turns, halfway) for i in range(sessions)))
    finally:
        await srv.stop()
        await engine.aclose()
    after = await _stats(urls)
    prompt = sum(after[u][0] - before[u][0] for u in urls)
    cached = sum(after[u][1] - before[u][1] for u in urls)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_ratio": cached / max(prompt, 1),
            "prefill_tokens": prompt - cached}  # fmt: skip


def _host_ip() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))
        return str(s.getsockname()[0])


async def run(sessions: int, turns: int, members: Any, urls: list[str], drop: Any) -> dict[str, Any]:
    from lockstep.rollout.session.engine import LiveReplicaPool

    out: dict[str, Any] = {"engines": len(urls), "sessions": sessions, "turns": turns}
    out["affinity"] = await _pass(LiveReplicaPool(members, refresh_s=0.5), urls, sessions, turns, 0)
    out["round_robin"] = await _pass(RoundRobin(urls), urls, sessions, turns, 0)
    pool = LiveReplicaPool(members, refresh_s=0.0)
    out["affinity_engine_lost"] = {
        **await _pass(pool, urls, sessions, turns, 1000, drop),
        "moved": pool.moved,
    }
    out["affinity_vs_round_robin_hit_ratio"] = out["affinity"]["hit_ratio"] / max(
        out["round_robin"]["hit_ratio"], 1e-9
    )
    out["round_robin_vs_affinity_prefill"] = out["round_robin"]["prefill_tokens"] / max(
        out["affinity"]["prefill_tokens"], 1
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument(
        "--endpointslices", action="store_true", help="list the engines through a real API server"
    )
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    async def go() -> dict[str, Any]:
        host = _host_ip() if a.endpointslices else "127.0.0.1"
        runners, urls = await _engines(2, host)
        try:
            if not a.endpointslices:
                listed = Listed(urls)
                return await run(a.sessions, a.turns, listed, urls, lambda: setattr(listed, "now", urls[1:]))
            return await _with_cluster(a, urls, host)
        finally:
            for r in runners:
                await r.cleanup()

    res = asyncio.run(go())
    res["members"] = "EndpointSlices (real API server)" if a.endpointslices else "a list"
    print(json.dumps(res, indent=1))
    print(f"prefix-cache hit ratio, affinity vs round robin: {res['affinity']['hit_ratio']:.2f} vs "
          f"{res['round_robin']['hit_ratio']:.2f} ({res['affinity_vs_round_robin_hit_ratio']:.2f}x); "
          f"prefill tokens {res['round_robin_vs_affinity_prefill']:.2f}x fewer with affinity")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


async def _with_cluster(a: argparse.Namespace, urls: list[str], host: str) -> dict[str, Any]:
    import os
    from urllib.parse import urlsplit

    from lockstep.serving.membership import EndpointSliceMembers

    from e2e.controlplane.cluster import ControlPlane, find_binaries

    cp = ControlPlane(bin_dir=find_binaries())
    cp.start()
    try:
        os.environ["KUBECONFIG"] = str(cp.kubeconfig)
        cp.kubectl("create", "namespace", "bench")
        cp.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "pool-router"},
                  "spec": {"ports": [{"name": "http", "port": 30000}]}}, namespace="bench")  # fmt: skip

        def put(i: int, ready: bool) -> None:
            port = urlsplit(urls[i]).port
            cp.apply({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                      "metadata": {"name": f"pool-router-{i}", "labels": {"kubernetes.io/service-name": "pool-router"}},
                      "addressType": "IPv4", "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
                      "endpoints": [{"addresses": [host], "conditions": {"ready": ready}}]}, namespace="bench")  # fmt: skip

        put(0, True)
        put(1, True)
        members = EndpointSliceMembers("pool-router", "bench")
        return await run(a.sessions, a.turns, members, urls, lambda: put(0, False))
    finally:
        cp.stop()


if __name__ == "__main__":
    main()
