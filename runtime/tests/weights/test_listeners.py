"""The weight-update group listens on the address towards its peers only, never on all interfaces.

A real gloo broadcast into the real reference engine on loopback; the sockets are read from /proc
while the group is up (the trainer is rank 0 and hosts the group's TCPStore; the engine joins it).
torch's TCPStore server binds `::` unless it is handed a bound socket (docs/security.md).
"""

from __future__ import annotations

from pathlib import Path

from listeners import listening, on_all_interfaces
from lockstep.weights.broadcast import BroadcastTransport, EngineTarget
from test_transports_engine import export, trainer_model
from weights_engine import EngineServer


def test_weight_update_group_binds_loopback_only(engine_server: EngineServer, tiny_dir: Path) -> None:
    before = listening()
    transport = BroadcastTransport([EngineTarget(engine_server.url)], backend="gloo")
    try:
        transport.update_weights(export(trainer_model(tiny_dir)), version=1)
        assert transport.group is not None  # the group (store and gloo pairs) is up now
        opened = listening() - before
        assert ("127.0.0.1", transport.master_port) in opened, opened  # the store is among them
        assert on_all_interfaces() == set(), listening()
    finally:
        transport.close()
