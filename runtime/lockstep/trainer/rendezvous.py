"""`lockstep launch`: torchrun whose rendezvous store listens on the pod's address, not on all interfaces.

Why it exists: torchrun's static rendezvous makes node rank 0's agent host the job's TCPStore on
MASTER_PORT, and torch's TCPStore server binds `::` (every interface) whatever host it is given;
no torchrun flag changes that (`--local-addr` only names the address published to the other
nodes). torch does keep a TCPStore to one address when it is handed a socket bound there
(`master_listen_fd`), and torchrun loads rendezvous backends from a registry. So this module
registers the backend `lockstep`: the static rendezvous (same env, same store for the workers),
with rank 0's store listening on $POD_IP (the downward API's pod IP), or else on the local address
that routes to MASTER_ADDR (loopback on one machine). `lockstep launch ARGS` is `torchrun ARGS` with
that backend. The workers' own listeners (gloo pairs, NCCL's bootstrap and sockets) bind one
interface's address already; docs/security.md lists every listener of a rank pod.

Endpoint and node rank come from `--rdzv-endpoint` / `--rdzv-conf rank=N` when given, else from the
torchrun env the operator sets on every rank pod (MASTER_ADDR, MASTER_PORT, NODE_RANK).

Who calls it: the trainer rank pods (`lockstep launch -m lockstep trainer --serve`), tests.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any

from lockstep.serving.weight_group import listening_store, local_address_towards

log = logging.getLogger(__name__)

BACKEND = "lockstep"
"""The rendezvous backend name (`--rdzv-backend`)."""
DEFAULT_TIMEOUT_S = 600
"""How long the nodes wait for each other (torchrun's static rendezvous default)."""


def bind_address(master_addr: str, master_port: int) -> str:
    """Where node rank 0's store listens: $POD_IP in a pod, else the local address towards the master."""
    return os.environ.get("POD_IP") or local_address_towards(master_addr, master_port)


def _endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of `--rdzv-endpoint`, or of MASTER_ADDR / MASTER_PORT (torchrun's defaults)."""
    if endpoint.strip():
        host, _, port = endpoint.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--rdzv-endpoint {endpoint!r}: give HOST:PORT, e.g. trainer-0.trainer:29500")
        return host.strip("[]"), int(port)
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))


def create_handler(params: Any) -> Any:
    """torchrun's handler factory for backend `lockstep` (RendezvousParameters -> RendezvousHandler)."""
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]
    from torch.distributed.elastic.rendezvous import RendezvousInfo
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class BoundStaticRendezvous(StaticTCPRendezvous):
        """torchrun's static rendezvous; the store of node rank 0 listens on one address only."""

        def get_backend(self) -> str:
            return BACKEND

        def next_rendezvous(self) -> Any:
            if self._store is None:
                if self.rank == 0:
                    bind = bind_address(self.master_addr, self.master_port)
                    self._store = listening_store(bind, self.master_port, self.world_size, self.timeout)
                else:
                    self._store = TCPStore(
                        self.master_addr, self.master_port, self.world_size, False, self.timeout
                    )
            store = PrefixStore(self.run_id, self._store)
            info = RendezvousStoreInfo(self.master_addr, self.master_port)
            return RendezvousInfo(store, self.rank, self.world_size, info)

    host, port = _endpoint(params.endpoint)
    rank = params.config.get("rank", os.environ.get("NODE_RANK", os.environ.get("PET_NODE_RANK", "0")))
    timeout = int(params.config.get("timeout", DEFAULT_TIMEOUT_S))
    return BoundStaticRendezvous(host, port, int(rank), params.max_nodes, params.run_id, timeout)


def register() -> None:
    """Make `--rdzv-backend lockstep` known to torchrun in this process (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    with contextlib.suppress(ValueError):  # already registered by an earlier call
        rendezvous_handler_registry.register(BACKEND, create_handler)


def launch(argv: Sequence[str]) -> int:
    """`torchrun ARGS` with `--rdzv-backend lockstep` (unless ARGS name another backend).

    SIGTERM: torchrun's agent passes it to the workers and waits for them (`--shutdown-timeout`,
    default 30 s, longer than the trainer's 25 s drain; then SIGKILL), then raises; that is a
    requested stop, so the exit code is 0 like the servers' own (the workers log how they ended).
    """
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    register()
    args = list(argv)
    if not any(a.startswith(("--rdzv-backend", "--rdzv_backend", "--standalone")) for a in args):
        args = ["--rdzv-backend", BACKEND, *args]
    try:
        main(args)
    except SignalException as e:
        if e.sigval != signal.SIGTERM:
            raise
        log.info("SIGTERM: the workers were stopped")
    return 0
