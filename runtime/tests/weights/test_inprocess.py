"""The in-process handoff into an embedded reference engine: versioned and checked like any transport.

The engine serves on its own event-loop thread (as `lockstep run` embeds it); the handoff copies the
trainer's tensors into its weights on that loop, under its step lock.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lockstep.api import load_manifest
from lockstep.config.trainer import transport_config
from lockstep.engine.handoff import EngineHandoff, HandoffRefused
from lockstep.weights.factory import build_transport
from lockstep.weights.from_disk import FromDiskTransport
from lockstep.weights.inprocess import InProcessTransport
from lockstep.weights.transport import MembershipChanged
from test_transports_engine import assert_engine_holds, export, trainer_model
from weights_engine import EngineServer


def handoff(server: EngineServer) -> EngineHandoff:
    return EngineHandoff(server.engine, server.loop, server.url)


def test_tensors_land_and_the_version_is_set_last(engine_server: EngineServer, tiny_dir: Path) -> None:
    named = export(trainer_model(tiny_dir))
    transport = InProcessTransport([handoff(engine_server)])
    report = transport.update_weights(iter(named), version=5)
    assert_engine_holds(engine_server, named, 5)
    assert report.wire_bytes == 0 and report.tensors == len(named)
    assert {"gather", "pause", "engine_load", "commit", "resume"} <= set(report.phases)
    assert not engine_server.engine.is_paused  # generation continues after the load
    # the engine holds copies: the trainer's next step does not reach it until the next update
    with torch.no_grad():
        named[0][1].add_(1.0)
    assert not torch.equal(engine_server.engine.named_weights()[named[0][0]], named[0][1])


def test_a_bad_tensor_changes_nothing(engine_server: EngineServer, tiny_dir: Path) -> None:
    before = {n: t.clone() for n, t in engine_server.engine.named_weights().items()}
    named = export(trainer_model(tiny_dir))
    name, t = named[-1]
    named[-1] = (name, t[:-1])  # one tensor of the wrong shape, last
    with pytest.raises(HandoffRefused, match=f"refused version 6: .*{name}.*unchanged"):
        InProcessTransport([handoff(engine_server)]).update_weights(named, version=6)
    after = engine_server.engine.named_weights()
    assert all(torch.equal(after[n], before[n]) for n in before)  # no weight moved
    assert engine_server.engine.weight_version == 0 and not engine_server.engine.is_paused
    with pytest.raises(HandoffRefused, match="not a parameter"):
        InProcessTransport([handoff(engine_server)]).update_weights([("nope.weight", t)], version=6)


def test_an_older_version_of_the_same_weights_is_refused(engine_server: EngineServer, tiny_dir: Path) -> None:
    named = export(trainer_model(tiny_dir))
    transport = InProcessTransport([handoff(engine_server)])
    transport.update_weights(named, version=3)
    transport.update_weights(named, version=2)  # new weights may carry an older label (a resumed run)
    assert engine_server.engine.weight_version == 2
    with pytest.raises(HandoffRefused, match="weight_version -1"):
        transport.update_weights(named, version=-1)


def test_auto_picks_in_process_only_for_embedded_engines(
    engine_server: EngineServer, tiny_dir: Path, tmp_path: Path
) -> None:
    job = transport_config(
        load_manifest((Path(__file__).parents[3] / "examples" / "tiny-local.yaml").read_text())
    )
    url = engine_server.url
    embedded = build_transport(job, tmp_path, tiny_dir, [url], "cpu", handoffs=[handoff(engine_server)])
    assert isinstance(embedded, InProcessTransport)
    with pytest.raises(MembershipChanged, match="in-process"):
        embedded.follow([url, "http://127.0.0.1:1"])
    external = build_transport(job, tmp_path, tiny_dir, [url, "http://127.0.0.1:1"], "cpu",
                               handoffs=[handoff(engine_server)])  # fmt: skip
    assert isinstance(external, FromDiskTransport)  # not every engine is in this process
    external.close()
