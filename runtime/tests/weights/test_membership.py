"""Every weight push reaches every engine of the pool, including engines that joined since the last push.

Why: in a cluster the trainer pushes to each engine's own address, listed by the pool's headless
Service, and a replaced or scaled-up engine starts from the base checkpoint; unless the next push
reaches it, it stays behind (not Ready) forever. Two real reference engines listen on the same port of
127.0.0.1 and 127.0.0.2, as two engine pods behind one headless Service; the membership source is
the real ServiceMembers with an injected resolver that first lists one address, then both. Checked
through each engine's real GET /model_info, and through the tensors the engine holds.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from lockstep.api import RLJob, load_manifest
from lockstep.config.trainer import transport_config
from lockstep.serving.membership import ServiceMembers, StaticMembers, members_from
from lockstep.weights.factory import build_transport
from lockstep.weights.fallback import Export
from lockstep.weights.p2p import P2PWriteError
from lockstep.weights.transport import (
    EngineSet,
    TransferReport,
    WeightTransport,
    update_members,
)

FIXTURE = Path(__file__).parents[1] / "driver" / "fixtures" / "tiny-fast.yaml"
HOSTS = ["127.0.0.1", "127.0.0.2"]


class Engines:
    """Reference engines served on HOSTS at one port by one private event loop thread."""

    def __init__(self, model_dir: Path, port: int) -> None:
        from aiohttp import web
        from lockstep.engine import ReferenceEngine, create_app

        self.port = port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engines: dict[str, Any] = {}
        self.runners: dict[str, Any] = {}
        for host in HOSTS:
            engine = ReferenceEngine.load(model_dir, device="cpu")
            runner = web.AppRunner(create_app(engine))

            async def start(r: Any = runner, h: str = host) -> None:
                await r.setup()
                await web.TCPSite(r, h, port).start()

            asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)
            self.engines[host], self.runners[host] = engine, runner

    def url(self, host: str) -> str:
        return f"http://{host}:{self.port}"

    def version(self, host: str) -> int:
        r = httpx.get(f"{self.url(host)}/model_info", timeout=5)
        r.raise_for_status()
        return int(r.json()["weight_version"])

    def stop(self, host: str) -> None:
        asyncio.run_coroutine_threadsafe(self.runners.pop(host).cleanup(), self.loop).result(60)

    def close(self) -> None:
        for runner in self.runners.values():
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lockstep.models.tiny import materialize_builtin

    return Path(materialize_builtin("tiny", tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def engines(tiny: Path) -> Iterator[Engines]:
    served = Engines(tiny, _free_port())
    yield served
    served.close()


def _job(transport: str) -> RLJob:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["weightSync"] = {"transport": transport}
    return load_manifest(yaml.safe_dump(doc))


class Pushes:
    """The trainer's weight updates (lockstep.trainer.local): the transport and the engine set it follows."""

    def __init__(
        self, transport: str, members: ServiceMembers, urls: list[str], tiny: Path, run_dir: Path
    ) -> None:
        self.transport: WeightTransport = build_transport(
            transport_config(_job(transport)), run_dir, tiny, urls, "cpu"
        )
        self.engines = EngineSet(members, sorted(urls))

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> TransferReport:
        return update_members(self.transport, self.engines, named, version)

    def close(self) -> None:
        self.transport.close()


def _weights(tiny: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The base checkpoint's tensors, every one moved (a trainer after a step), in HF names."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    base = load_file(str(tiny / "model.safetensors"))
    return [(n, t + torch.randn(t.shape, generator=g).to(t.dtype) * 0.01) for n, t in sorted(base.items())]


def _holds(engines: Engines, host: str, named: list[tuple[str, torch.Tensor]]) -> bool:
    live = engines.engines[host].named_weights()
    return all(torch.equal(live[n].cpu().to(t.dtype), t) for n, t in named)


@pytest.mark.parametrize("transport", ["auto", "broadcast", "disk-delta"])
def test_an_engine_that_joined_gets_the_next_update(
    transport: str, engines: Engines, tiny: Path, tmp_path: Path
) -> None:
    listed = ["127.0.0.1"]
    members = ServiceMembers("pool-engines", engines.port, resolve=lambda host, port: list(listed))
    pushes = Pushes(transport, members, [engines.url("127.0.0.1")], tiny, tmp_path)
    try:
        report = pushes.update_weights(_weights(tiny, 1), 1)
        assert (engines.version("127.0.0.1"), engines.version("127.0.0.2")) == (1, 0)
        assert report.extra["update_weights_engines"] == 1.0

        listed.append("127.0.0.2")  # a new engine pod: base checkpoint, version 0
        v2 = _weights(tiny, 2)
        report = pushes.update_weights(v2, 2)
        assert (engines.version("127.0.0.1"), engines.version("127.0.0.2")) == (2, 2)
        assert report.extra["update_weights_engines"] == 2.0
        assert _holds(engines, "127.0.0.1", v2) and _holds(engines, "127.0.0.2", v2)

        listed.remove("127.0.0.1")  # that pod is gone from the Service: dropped, not an error
        v3 = _weights(tiny, 3)
        report = pushes.update_weights(v3, 3)
        assert engines.version("127.0.0.2") == 3 and _holds(engines, "127.0.0.2", v3)
        assert report.extra["update_weights_engines"] == 1.0
    finally:
        pushes.close()


def test_an_update_to_an_engine_that_is_down_fails_naming_it(
    engines: Engines, tiny: Path, tmp_path: Path
) -> None:
    members = ServiceMembers("pool-engines", engines.port, resolve=lambda host, port: list(HOSTS))
    pushes = Pushes("auto", members, [engines.url(h) for h in HOSTS], tiny, tmp_path)
    try:
        pushes.update_weights(_weights(tiny, 1), 1)
        engines.stop("127.0.0.2")  # crashed, still listed by the Service
        with pytest.raises(Exception, match=r"127\.0\.0\.2") as e:
            pushes.update_weights(_weights(tiny, 2), 2)
        assert "127.0.0.1" not in str(e.value).replace(engines.url("127.0.0.2"), "")
    finally:
        pushes.close()


def test_a_listed_engine_that_does_not_serve_yet_joins_a_later_update(
    engines: Engines, tiny: Path, tmp_path: Path
) -> None:
    listed = ["127.0.0.1", "127.0.0.3"]  # .3: a pod with an IP whose server has not started
    members = ServiceMembers("pool-engines", engines.port, resolve=lambda host, port: list(listed))
    pushes = Pushes("auto", members, [engines.url("127.0.0.1")], tiny, tmp_path)
    try:
        report = pushes.update_weights(_weights(tiny, 1), 1)
        assert report.extra["update_weights_engines"] == 1.0 and engines.version("127.0.0.1") == 1
    finally:
        pushes.close()


def _export(named: list[tuple[str, torch.Tensor]], exports: list[int] | None = None) -> Export:
    """The trainer's export as the trainer passes it: iterable again when a transport falls back."""

    def again() -> Iterator[tuple[str, torch.Tensor]]:
        if exports is not None:
            exports.append(1)
        yield from named

    return Export(again)


def test_p2p_follows_engines_that_join_and_leave(engines: Engines, tiny: Path, tmp_path: Path) -> None:
    """Engines scaled 1 -> 2 -> 1 between updates: the joining engine's receive buffer is fetched and
    the plan made again before the next update; every update lands whole in every live engine."""
    listed = ["127.0.0.1"]
    members = ServiceMembers("pool-engines", engines.port, resolve=lambda host, port: list(listed))
    pushes = Pushes("p2p", members, [engines.url("127.0.0.1")], tiny, tmp_path)
    try:
        v1 = _weights(tiny, 1)
        report = pushes.update_weights(_export(v1), 1)
        assert engines.version("127.0.0.1") == 1 and _holds(engines, "127.0.0.1", v1)
        assert report.transport == "p2p" and report.extra["update_weights_fallback"] == 0.0
        listed.append("127.0.0.2")  # scaled to 2: a new engine at version 0
        for version in (2, 3):
            named = _weights(tiny, version)
            report = pushes.update_weights(_export(named), version)
            assert (engines.version("127.0.0.1"), engines.version("127.0.0.2")) == (version, version)
            assert _holds(engines, "127.0.0.1", named) and _holds(engines, "127.0.0.2", named)
            assert report.transport == "p2p" and report.extra["update_weights_engines"] == 2.0
        assert report.extra["update_weights_p2p_replans"] == 1.0  # planned once for the join, not per update
        assert report.phases["membership"] > 0
        listed.remove("127.0.0.1")  # scaled back to 1
        v4 = _weights(tiny, 4)
        report = pushes.update_weights(_export(v4), 4)
        assert engines.version("127.0.0.2") == 4 and _holds(engines, "127.0.0.2", v4)
        assert engines.version("127.0.0.1") == 3  # gone from the Service: not reached any more
        assert (
            report.extra["update_weights_engines"] == 1.0
            and report.extra["update_weights_p2p_replans"] == 2.0
        )
    finally:
        pushes.close()


def test_a_failed_p2p_update_is_delivered_by_broadcast_and_reported(
    engines: Engines, tiny: Path, tmp_path: Path
) -> None:
    """A P2P write that fails (here: a target whose receive buffer moved, as after an engine restart
    at the same address) does not stop the run nor leave engines half-updated: the same version is
    exported again and broadcast to every engine; the report says so. The next update is P2P again,
    with every target's buffer fetched anew."""
    listed = list(HOSTS)
    members = ServiceMembers("pool-engines", engines.port, resolve=lambda host, port: list(listed))
    pushes = Pushes("p2p", members, [engines.url(h) for h in HOSTS], tiny, tmp_path)
    try:
        pushes.update_weights(_export(_weights(tiny, 1)), 1)
        p2p = pushes.transport.primary  # type: ignore[attr-defined]
        moved = p2p.all_targets[1].info
        moved.buffer_ptr += 1 << 40  # the registered buffer is elsewhere now: the write is refused
        v2, exports = _weights(tiny, 2), []
        report = pushes.update_weights(_export(v2, exports), 2)
        assert report.transport == "p2p->broadcast" and report.extra["update_weights_fallback"] == 1.0
        assert report.extra["update_weights_fallback_broadcast"] == 1.0 and len(exports) == 2
        for host in HOSTS:  # the same version, whole, everywhere
            assert engines.version(host) == 2 and _holds(engines, host, v2)
        v3 = _weights(tiny, 3)
        report = pushes.update_weights(_export(v3), 3)
        assert report.transport == "p2p" and report.extra["update_weights_fallback"] == 0.0
        assert all(engines.version(h) == 3 and _holds(engines, h, v3) for h in HOSTS)
    finally:
        pushes.close()


def test_without_a_second_export_a_p2p_failure_is_raised_not_hidden(
    engines: Engines, tiny: Path, tmp_path: Path
) -> None:
    members = ServiceMembers("pool-engines", engines.port, resolve=lambda host, port: ["127.0.0.1"])
    pushes = Pushes("p2p", members, [engines.url("127.0.0.1")], tiny, tmp_path)
    try:
        pushes.transport.primary.all_targets[0].info.buffer_ptr += 1 << 40  # type: ignore[attr-defined]
        with pytest.raises(P2PWriteError, match="failed"):
            pushes.update_weights(_weights(tiny, 1), 1)  # a plain list: it cannot be sent twice
        assert engines.version("127.0.0.1") == 0  # nothing loaded
    finally:
        pushes.close()


def test_members_from_flags_and_env() -> None:
    assert members_from(["http://e:1"], {"LOCKSTEP_ENGINES_SERVICE": "s"}) == StaticMembers(("http://e:1",))
    env = {"LOCKSTEP_ENGINES_SERVICE": "j-rollout-engines", "LOCKSTEP_ROUTER_URL": "http://j-rollout:30000"}
    assert members_from([], env) == ServiceMembers("j-rollout-engines", 30000)  # the router is for rollouts
    assert members_from([], {"LOCKSTEP_ROUTER_URL": "http://r:1"}) == StaticMembers(("http://r:1",))
    assert members_from([], {}) is None
    assert ServiceMembers("no-such-engines.invalid").urls() == []  # no pod yet: no member, not a crash


def test_rank0_waits_for_a_serving_engine_and_names_the_service_when_none(engines: Engines) -> None:
    from lockstep.trainer.server import _wait_for_engines

    listed: list[str] = []
    now = [0.0]

    def sleep(s: float) -> None:  # the injected clock; pods appear in the Service at t = 3 s
        now[0] += s
        if now[0] >= 3:
            listed[:] = ["127.0.0.1", "127.0.0.3"]  # .3 has an IP but serves nothing yet

    members = ServiceMembers("pool-engines", engines.port, resolve=lambda host, port: list(listed))
    got = _wait_for_engines(members, 60, clock=lambda: now[0], sleep=sleep)
    assert got == [engines.url("127.0.0.1")] and now[0] == 3

    silent = ServiceMembers("pool-engines", engines.port, resolve=lambda host, port: ["127.0.0.3"])
    with pytest.raises(
        TimeoutError, match=r"headless Service pool-engines:\d+ after 5 s \(listed: http://127\.0\.0\.3"
    ):
        _wait_for_engines(silent, 5, clock=lambda: now[0], sleep=sleep)


def test_the_preflight_checks_the_engines_of_the_moment(engines: Engines, tiny: Path, tmp_path: Path) -> None:
    """Found on the real node: the engine pod was replaced (a new address) before a restarted driver's
    first update; the pre-flight still read the old address back and failed the driver forever
    (EngineUnreachable at /weights_checker). It checks the engines each update reaches now."""
    from lockstep.config.trainer import trainer_config
    from lockstep.train.factory import build_backend
    from lockstep.trainer.local import LocalTrainer
    from lockstep.trainer.parts import build_trainer_parts

    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["weightSync"] = {"transport": "broadcast", "checkWeightUpdateEqual": True}
    job = load_manifest(yaml.safe_dump(doc))
    listed = ["127.0.0.1"]
    members = ServiceMembers("pool-engines", engines.port, resolve=lambda host, port: list(listed))
    config = trainer_config(job)
    backend = build_backend(config.backend, tiny)
    closers: list[Any] = [backend.close]
    try:
        parts = build_trainer_parts(
            config, tmp_path, tiny, backend, [engines.url("127.0.0.1")], closers, "127.0.0.1", members
        )
        engines.stop("127.0.0.1")  # the engine pod replaced: the Service lists only the new one
        listed[:] = ["127.0.0.2"]
        metrics = LocalTrainer(parts).first_update(0)
    finally:
        for fn in reversed(closers):
            fn()
    assert metrics["preflight_tensors"] > 0
    assert engines.version("127.0.0.2") == 0


def test_a_driver_pods_session_members_fall_back_to_the_headless_service() -> None:
    """In a driver pod the session routing lists the router's EndpointSlices and, while that list is
    forbidden, the engines of the headless Service that answer /health (docs/tito.md, "Affinity")."""
    from lockstep.serving.membership import HealthyMembers, session_members

    env = {
        "LOCKSTEP_ROUTER_URL": "http://pool-router.ns.svc:30000",
        "POD_NAMESPACE": "ns",
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "LOCKSTEP_ENGINES_SERVICE": "pool-engines.ns.svc",
    }
    members = session_members(env)
    assert members is not None and members.service == "pool-router"
    assert isinstance(members.fallback, HealthyMembers)
    assert members.fallback.source == ServiceMembers("pool-engines.ns.svc", 30000)
    no_headless = session_members({k: v for k, v in env.items() if k != "LOCKSTEP_ENGINES_SERVICE"})
    assert no_headless is not None and no_headless.fallback is None
