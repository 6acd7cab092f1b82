"""Session routing over EndpointSlices of a real API server: a driver's session server keeps every
turn of a session on one engine listed by the pool's router Service, and moves a session only when
its engine leaves the list (docs/tito.md, "Affinity").

Two real reference engines serve on this machine's address; a Service without a selector lists them
through two EndpointSlices the test writes (on the real node the endpoints controller writes them from
the engine pods' readiness: e2e/test_realpods_affinity.py runs a job with two engine pods there). Which engine served each
turn is read from the engines' own counters (GET /engine_stats).

The second test lists as a driver's ServiceAccount (impersonated) whose Role lacks the list verb: the
real RBAC answers 403, routing falls back to the engines that answer /health, warns once naming the
verb, and reads the EndpointSlices again once a Role grants it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from lockstep.kube import api_client
from lockstep.rollout.session.engine import LiveReplicaPool
from lockstep.rollout.session.server import SessionServer, SessionServerConfig
from lockstep.serving.membership import (
    EndpointSliceMembers,
    HealthyMembers,
    StaticMembers,
    engine_url,
    probe_health,
)
from lockstep_operator.resources.config import SESSION_ROUTING_RULE

from e2e.controlplane.cluster import ControlPlane

pytestmark = pytest.mark.e2e
SERVICE = "pool-router"
CONVERSATION = "<|user|>hi<|assistant|>hello<|eos|><|user|>bye<|assistant|>bye now<|eos|>"


def _host_ip() -> str:
    """This machine's outward IPv4 address (an EndpointSlice may not list loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route's source address
        return str(s.getsockname()[0])


def _trained_tiny(out: Path) -> Path:
    """The built-in tiny model taught one two-turn conversation (so greedy replies end their turn)."""
    import torch
    from lockstep.models.tiny import chat_tokenizer, materialize_builtin, save_tokenizer
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(materialize_builtin("builtin:tiny", out / "base", seed=0))
    ids = torch.tensor([chat_tokenizer().encode(CONVERSATION)])
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    for _ in range(60):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out / "trained")
    save_tokenizer(out / "trained")
    return out / "trained"


def _slice(name: str, ip: str, port: int, ready: bool) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": SERVICE}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}}],
    }


async def _serve(model: Path, ip: str) -> tuple[web.AppRunner, int]:
    from lockstep.engine.core import ReferenceEngine
    from lockstep.engine.server import create_app

    runner = web.AppRunner(create_app(ReferenceEngine.load(model, context_length=512)), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, ip, 0).start()
    return runner, int(runner.addresses[0][1])


async def _turn(h: httpx.AsyncClient, srv: str, sid: str, msgs: list[dict[str, Any]]) -> None:
    msgs.append({"role": "user", "content": "bye" if msgs else "hi"})
    msgs.append(await _reply(h, srv, sid, msgs))


async def _retry(h: httpx.AsyncClient, srv: str, sid: str, msgs: list[dict[str, Any]]) -> None:
    """Ask again for the newest reply (a linear session's retry: a turn of the session). Only the two
    taught turns are ever asked for: an untaught reply may run to max_tokens on some machines' float
    rounding, and a turn that ended on the budget cannot be extended (409)."""
    msgs[-1] = await _reply(h, srv, sid, msgs[:-1])


async def _reply(h: httpx.AsyncClient, srv: str, sid: str, msgs: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"messages": msgs, "max_tokens": 16, "temperature": 0.0}
    r = await h.post(f"{srv}/sessions/{sid}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()["choices"][0]["message"]
    return reply


async def _served(h: httpx.AsyncClient, urls: list[str]) -> dict[str, int]:
    return {u: (await h.get(f"{u}/engine_stats")).json()["requests"] for u in urls}


async def _engines(cluster: ControlPlane, ns: str, model: Path, ip: str) -> tuple[list[Any], list[str]]:
    """Two engines on `ip`, and the router Service's two ready EndpointSlices listing them."""
    engines = [await _serve(model, ip) for _ in range(2)]
    cluster.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": SERVICE},
                   "spec": {"ports": [{"name": "http", "port": 30000}]}}, namespace=ns)  # fmt: skip
    for i, (_, port) in enumerate(engines):
        cluster.apply(_slice(f"{SERVICE}-{i}", ip, port, True), namespace=ns)
    return engines, [engine_url(ip, port) for _, port in engines]


async def _sticky_sessions(
    h: httpx.AsyncClient, srv: str, urls: list[str], history: dict[str, Any]
) -> dict[str, str]:
    """Sessions one at a time, 2 turns each, until both engines own one (at least 6, at most 24: the
    ring places random session ids, so 6 land on one engine about 3% of the time): every session's
    turns on one engine, both engines used."""
    owner: dict[str, str] = {}
    while len(owner) < 6 or (set(owner.values()) != set(urls) and len(owner) < 24):
        sid = (await h.post(f"{srv}/sessions", json={})).json()["session_id"]
        history[sid] = []
        before = await _served(h, urls)
        for _ in range(2):
            await _turn(h, srv, sid, history[sid])
        after = await _served(h, urls)
        served = {u: after[u] - before[u] for u in urls}
        assert sorted(served.values()) == [0, 2], served
        owner[sid] = next(u for u in urls if served[u])
    assert set(owner.values()) == set(urls)
    return owner


async def _scenario(cluster: ControlPlane, ns: str, model: Path, ip: str) -> None:
    engines, urls = await _engines(cluster, ns, model, ip)
    members = EndpointSliceMembers(SERVICE, ns)  # the kubernetes client, KUBECONFIG as in a test
    assert members.urls() == sorted(urls)
    pool = LiveReplicaPool(members, refresh_s=0.0)
    srv = SessionServer(SessionServerConfig(family="tiny"), pool)
    await srv.start()
    history: dict[str, list[dict[str, Any]]] = {}
    try:
        async with httpx.AsyncClient(timeout=60.0) as h:
            owner = await _sticky_sessions(h, srv.url, urls, history)
            # engine 0's pod stops being ready (deleted, or not at the current weight version)
            cluster.apply(_slice(f"{SERVICE}-0", ip, engines[0][1], False), namespace=ns)
            assert members.urls() == [urls[1]]
            before = await _served(h, urls)
            for sid in owner:
                await _retry(h, srv.url, sid, history[sid])
            after = await _served(h, urls)
            assert after[urls[0]] == before[urls[0]] and after[urls[1]] - before[urls[1]] == len(owner)
            assert pool.moved == sum(1 for u in owner.values() if u == urls[0])
    finally:
        await srv.stop()
        await pool.aclose()
        for runner, _ in engines:
            await runner.cleanup()


def test_sessions_stick_to_one_engine_of_the_router_endpointslices(
    cluster: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    asyncio.run(_scenario(cluster, namespace, _trained_tiny(tmp_path), _host_ip()))


def _as_driver(cluster: ControlPlane, ns: str) -> Any:
    """A kubernetes ApiClient acting as ServiceAccount `driver` of `ns` (admin impersonation: the
    apiserver's RBAC decides), which a Role may grant things to."""
    cluster.apply(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "driver"}}, namespace=ns
    )
    api = api_client()
    api.set_default_header("Impersonate-User", f"system:serviceaccount:{ns}:driver")
    return api


def _grant_session_routing(cluster: ControlPlane, ns: str) -> None:
    """The operator's session-routing rule, as a Role bound to ServiceAccount `driver`."""
    name = "driver-sessions"
    cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": name},
                   "rules": [SESSION_ROUTING_RULE]}, namespace=ns)  # fmt: skip
    cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": name},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                   "subjects": [{"kind": "ServiceAccount", "name": "driver", "namespace": ns}]}, namespace=ns)  # fmt: skip


async def _forbidden_scenario(
    cluster: ControlPlane, ns: str, model: Path, ip: str, caplog: pytest.LogCaptureFixture
) -> None:
    engines, urls = await _engines(cluster, ns, model, ip)
    members = EndpointSliceMembers(
        SERVICE,
        ns,
        api=_as_driver(cluster, ns),
        # real /health probes, with time to answer on the suite's busy cores (a slow probe drops its engine)
        fallback=HealthyMembers(
            StaticMembers(tuple(urls)), healthy=lambda u: probe_health(u, timeout_s=30.0)
        ),
    )
    with caplog.at_level(logging.WARNING, logger="lockstep.serving.membership"):
        # the real apiserver says 403 and the fallback answers (in a thread: its /health probes are
        # answered by the engines on this event loop)
        assert await asyncio.to_thread(members.urls) == sorted(urls)
        assert members.forbidden
        pool = LiveReplicaPool(members, refresh_s=0.0)  # lists again at every turn
        srv = SessionServer(SessionServerConfig(family="tiny"), pool)
        await srv.start()
        try:
            async with httpx.AsyncClient(timeout=60.0) as h:
                await _sticky_sessions(h, srv.url, urls, {})
        finally:
            await srv.stop()
            await pool.aclose()
    warnings = [r.getMessage() for r in caplog.records if "cannot list" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once, though the list was denied at every turn
    for fix in ('"list"', '"endpointslices"', '"discovery.k8s.io"', f"namespace {ns}", "403"):
        assert fix in warnings[0], (fix, warnings[0])
    try:
        # a Role grants the verb: the EndpointSlices decide again (engine 0 up, but its slice not ready)
        _grant_session_routing(cluster, ns)
        cluster.apply(_slice(f"{SERVICE}-0", ip, engines[0][1], False), namespace=ns)
        await asyncio.to_thread(
            cluster.wait_for, lambda: members.urls() == [urls[1]], timeout=30, what="the granted list"
        )
        assert not members.forbidden
    finally:
        for runner, _ in engines:
            await runner.cleanup()


def test_routing_falls_back_and_warns_once_when_endpointslices_are_forbidden(
    cluster: ControlPlane, namespace: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    asyncio.run(_forbidden_scenario(cluster, namespace, _trained_tiny(tmp_path), _host_ip(), caplog))
