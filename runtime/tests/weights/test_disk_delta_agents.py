"""disk-delta per host: the trainer publishes once, each engine's agent patches its own copy and reloads.

Two real reference engines (127.0.0.1 and 127.0.0.2, one port, as two engine pods behind a headless
Service), each with its agent (lockstep.weights.delta_agent's real HTTP app, on the agents' port of the
same address) keeping that engine's local copy in its own directory; the trainer side is
SharedDiskDelta over a shared root. Checked: the trainer wrote the whole checkpoint once and only
deltas after; each agent patched its own copy, whose checksums are the trainer's; every engine holds
the trainer's tensors at the version; a corrupted delta is refused by the agents, the engines keep
their weights and version, and the update fails naming the engines; an engine that joins later is
brought up by its agent from the base and the chain.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lockstep.models import st_bytes as sb
from lockstep.serving.membership import ServiceMembers
from lockstep.weights import disk_delta as dd
from lockstep.weights.delta_agent import AGENTS_DIR, AgentState, DeltaAgent, create_app
from lockstep.weights.disk_delta_shared import SharedDiskDelta
from lockstep.weights.transport import EngineSet, update_members
from test_membership import HOSTS, Engines, _holds, _weights


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Agents:
    """One DeltaAgent per engine host, served on `port` of that host by a private loop thread."""

    def __init__(self, root: Path, engines: Engines, local: Path, port: int) -> None:
        from aiohttp import web

        self.port = port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.agents: dict[str, DeltaAgent] = {}
        self.runners: list[Any] = []
        for host in HOSTS:
            agent = DeltaAgent(root, local / host, engines.url(host), name=f"engine-{host}")
            runner = web.AppRunner(create_app(agent))

            async def start(r: Any = runner, h: str = host) -> None:
                await r.setup()
                await web.TCPSite(r, h, port).start()

            asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)
            self.agents[host] = agent
            self.runners.append(runner)

    def close(self) -> None:
        for runner in self.runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def engines(tiny: Path) -> Iterator[Engines]:
    served = Engines(tiny, _free_port())
    yield served
    served.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lockstep.models.tiny import materialize_builtin

    return Path(materialize_builtin("tiny", tmp_path_factory.mktemp("tiny")))


def _both_hosts(
    engines: Engines, tiny: Path, run_dir: Path, local: Path
) -> tuple[Agents, SharedDiskDelta, EngineSet]:
    """An agent per host of HOSTS, and the trainer's transport and engine set over both."""
    agents = Agents(run_dir / "delta", engines, local, _free_port())
    members = ServiceMembers("pool-engines", engines.port, resolve=lambda host, port: list(HOSTS))
    urls = [engines.url(h) for h in HOSTS]
    transport = SharedDiskDelta(run_dir, tiny, urls, agent_port=agents.port, connect_wait_s=5)
    return agents, transport, EngineSet(members, urls)


def test_each_engine_patches_its_own_copy_and_refuses_a_corrupt_delta(
    engines: Engines, tiny: Path, tmp_path: Path
) -> None:
    run_dir, local = tmp_path / "shared" / "lockstep" / "job", tmp_path / "node-local"
    agents, transport, engine_set = _both_hosts(engines, tiny, run_dir, local)
    try:
        full = sum(p.stat().st_size for p in tiny.glob("*.safetensors"))
        v0 = _weights(tiny, 0)
        first = update_members(transport, engine_set, v0, 0)
        assert first.wire_bytes >= full  # the whole checkpoint, written once for every engine
        for version in (1, 2):
            named = _weights(tiny, version)
            report = update_members(transport, engine_set, named, version)
            # only the changed bytes after version 0: less than one full copy, let alone one per engine
            assert 0 < report.wire_bytes < full and 0 < report.extra["update_weights_density"] <= 1
            index = dd.load_index(run_dir / "delta", version)
            assert report.extra["update_weights_wire_bytes"] == index.metrics["update_weights_wire_bytes"]
            for host in HOSTS:
                assert engines.version(host) == version and _holds(engines, host, named)
                copy = local / host  # this engine's own copy, patched by its agent
                on_disk = {
                    e.name: sb.checksum(d, index.checksum_format) for e, d in sb.iter_checkpoint_bytes(copy)
                }
                assert on_disk == {n: s.checksum for n, s in index.state.items()}  # the trainer's checksums
                state = AgentState.model_validate_json(
                    (run_dir / "delta" / AGENTS_DIR / f"engine-{host}.json").read_text()
                )
                assert state.version == version and state.applied == [version] and state.error is None
        assert sorted(p.name for p in (run_dir / "delta").glob("weight_v*")) == [
            "weight_v000001",
            "weight_v000002",
        ]

        # a delta damaged on the shared store: refused by every agent, no engine reloads
        v3 = _weights(tiny, 3)
        before = {h: dict(engines.engines[h].named_weights()) for h in HOSTS}
        before = {h: {n: t.clone() for n, t in w.items()} for h, w in before.items()}
        transport.publisher.publish(v3, 3)  # type: ignore[union-attr]
        shard = next((run_dir / "delta" / "weight_v000003").glob("delta-*.safetensors"))
        data = bytearray(shard.read_bytes())
        data[-100] ^= 0xFF
        shard.write_bytes(bytes(data))
        with pytest.raises(dd.DeltaError, match=r"did not reach every engine.*refused version 3"):
            transport._sync_all(3)
        for host in HOSTS:
            assert engines.version(host) == 2  # not reloaded
            live = engines.engines[host].named_weights()
            assert all(torch.equal(live[n], t) for n, t in before[host].items())
            assert dd.read_local_state(local / host).version == 2  # the copy as it was
            assert "version 3" in (agents.agents[host].state.error or "")
    finally:
        transport.close()
        agents.close()


def test_an_engine_that_joins_is_brought_up_by_its_agent(
    engines: Engines, tiny: Path, tmp_path: Path
) -> None:
    run_dir, local = tmp_path / "run", tmp_path / "node-local"
    agents = Agents(run_dir / "delta", engines, local, _free_port())
    listed = ["127.0.0.1"]
    members = ServiceMembers("pool-engines", engines.port, resolve=lambda host, port: list(listed))
    transport = SharedDiskDelta(run_dir, tiny, [engines.url("127.0.0.1")], agent_port=agents.port)
    engine_set = EngineSet(members, [engines.url("127.0.0.1")])
    try:
        for version in (0, 1, 2):
            update_members(transport, engine_set, _weights(tiny, version), version)
        listed.append("127.0.0.2")  # joins at version 0 with the base checkpoint
        v3 = _weights(tiny, 3)
        update_members(transport, engine_set, v3, 3)
        assert all(engines.version(h) == 3 and _holds(engines, h, v3) for h in HOSTS)
        state = agents.agents["127.0.0.2"].state
        assert state.copied_base and state.applied == [1, 2, 3]  # the base, then the whole chain
    finally:
        transport.close()
        agents.close()


def test_a_repeated_version_starts_a_new_chain(engines: Engines, tiny: Path, tmp_path: Path) -> None:
    """A driver that restarted resumes at a version already published (its first update repeats it):
    versions are immutable, so the trainer writes a new base and every agent copies it."""
    run_dir, local = tmp_path / "run", tmp_path / "node-local"
    agents, transport, engine_set = _both_hosts(engines, tiny, run_dir, local)
    try:
        for version in (0, 1):
            update_members(transport, engine_set, _weights(tiny, version), version)
        token = (run_dir / "delta" / "base" / "TOKEN").read_text()
        again = _weights(tiny, 5)  # the resumed trainer's tensors at version 1
        report = update_members(transport, engine_set, again, 1)
        full = sum(p.stat().st_size for p in tiny.glob("*.safetensors"))
        assert report.wire_bytes >= full  # a new base, written once
        assert (run_dir / "delta" / "base" / "TOKEN").read_text() != token
        assert sorted(p.name for p in (run_dir / "delta" / "base").glob("weight_v*")) == ["weight_v000001"]
        for host in HOSTS:
            assert engines.version(host) == 1 and _holds(engines, host, again)
            state = agents.agents[host].state
            assert state.copied_base and state.applied == [] and state.version == 1, state
        v2 = _weights(tiny, 2)
        report = update_members(transport, engine_set, v2, 2)  # deltas again, on the new chain
        assert 0 < report.wire_bytes < full
        assert all(engines.version(h) == 2 and _holds(engines, h, v2) for h in HOSTS)
    finally:
        transport.close()
        agents.close()
