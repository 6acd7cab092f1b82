"""The weight-update group listens on the address towards its peers only, never on all interfaces.

A real gloo broadcast into the real reference engine on loopback; the sockets are read from /proc
while the group is up (the trainer is rank 0 and hosts the group's TCPStore; the engine joins it).
torch's TCPStore server binds `::` unless it is handed a bound socket (docs/security.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
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


@pytest.mark.gpu
def test_nccl_weight_update_group_binds_no_wildcard(tiny_dir: Path) -> None:
    """The same over NCCL (one GPU per rank): the store, NCCL's bootstrap and its socket transport,
    in this process (rank 0) and in the engine's process (rank 1)."""
    import torch
    from test_gpu import trainer_export
    from weights_subproc import EngineProcess

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank (trainer source + engine); this machine has fewer")
    engine = EngineProcess(
        tiny_dir, device="cuda", extra=["--dtype", "bfloat16"], env={"CUDA_VISIBLE_DEVICES": "1"}
    )
    transport = BroadcastTransport([EngineTarget(engine.url)], backend="nccl", device="cuda")
    try:
        transport.update_weights(trainer_export(tiny_dir), version=1)
        assert transport.group is not None
        assert ("127.0.0.1", transport.master_port) in listening()
        wildcard = on_all_interfaces() | on_all_interfaces(engine.proc.pid)
        assert wildcard == set(), (listening(), listening(engine.proc.pid))
    finally:
        transport.close()
        engine.close()
