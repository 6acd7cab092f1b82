"""The weight-update process group of /init_weights_update_group, shared by trainer and engine.

Why it exists: SGLang's /init_weights_update_group makes the engine join a new torch.distributed
group with the trainer's rank 0 (rank 0 = the source, engine ranks from rank_offset), rendezvous at
tcp://master_address:master_port, keys under the group name. Both ends must build the group the
same way, and neither may disturb its process's default group (the trainer's FSDP world). So the
group is a standalone c10d backend (ProcessGroupGloo / ProcessGroupNCCL) on a TCPStore wrapped in
PrefixStore(f"{group_name}/"), which is what torch's own new-group helper does; broadcasts go
through the backend object directly.

Who calls it: lockstep.engine (engine side, ranks >= 1) and lockstep.weights (trainer rank 0).
torch is imported inside the functions so importing lockstep.serving stays light.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any


def on_the_wire(tensor: Any) -> Any:
    """What a broadcast carries for `tensor`: its bytes as uint8 for the 1-byte float dtypes (FP8
    weights, E8M0 scales), which gloo refuses and NCCL moves as bytes anyway, else the tensor itself.

    Both ends apply it to contiguous tensors of the announced dtype, so the bytes that arrive are
    exactly the bytes sent (SGLang's receiver, posting the FP8 dtype on NCCL, gets the same bytes).
    """
    import torch

    if tensor.dtype.is_floating_point and tensor.element_size() == 1:
        return tensor.view(torch.uint8)
    return tensor


@dataclass(slots=True)
class WeightUpdateGroup:
    """A standalone process group for weight broadcasts."""

    name: str
    """group_name of the request."""
    backend: str
    """gloo or nccl."""
    rank: int
    """This process's rank (0 = the trainer source)."""
    world_size: int
    """1 + the engine ranks."""
    pg: Any
    """The c10d backend object (ProcessGroupGloo or ProcessGroupNCCL)."""
    store: Any
    """The TCPStore, kept alive as long as the group."""
    keys: Any = None
    """The group's prefixed view of the store (where the size-preamble capability keys are)."""
    _preamble: bool | None = None

    def announces_sizes(self) -> bool:
        """Whether every update on this group starts with the size preamble (`size_preamble`): true
        when every rank advertised it at join (open_weight_update_group(announce_sizes=True)); a stock
        SGLang engine or a sender that does not send it leaves it off for the whole group. Decided at
        the first update, when every rank has joined, and the same on every rank."""
        if self._preamble is None:
            wanted = [f"{PREAMBLE_KEY}/{r}" for r in range(self.world_size)]
            self._preamble = self.keys is not None and bool(self.keys.check(wanted))
        return self._preamble

    def broadcast(self, tensor: Any, src: int = 0) -> None:
        """Broadcast `tensor` in place from rank `src` to every rank of the group; blocks until done."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        """Drop the group (NCCL communicators are aborted; gloo closes its sockets on delete)."""
        shutdown = getattr(self.pg, "shutdown", None) or getattr(self.pg, "abort", None)
        if shutdown is not None and self.backend == "nccl":
            shutdown()
        self.pg = None
        self.store = None
        self.keys = None


PREAMBLE_KEY = "lockstep-size-preamble-v1"
"""Store key (under the group's prefix, one per rank) by which a rank says it sends or checks the
size preamble. Stock SGLang never sets it, so the preamble stays off in a group with a stock engine."""
_PREAMBLE_MAGIC = 0x4C4B5354  # "LKST"


def size_preamble(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[int]:
    """The 4 int64 values a sender broadcasts before an update's data: a magic number, the tensor
    count, the total bytes and a digest of every (name, dtype, shape), computed from what it sends.

    Why: a receiver posts each collective with the size the HTTP request announced, and gloo aborts the
    whole receiving process when more bytes arrive than it posted (and silently accepts fewer). The
    preamble has a fixed size on both ends, so comparing it with the announcement catches a mismatch
    before any data collective is posted."""
    import hashlib

    import torch

    total, text = 0, []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dt = getattr(torch, dtype.removeprefix("torch."))
        total += torch.Size(shape).numel() * dt.itemsize
        text.append(f"{name}:{dtype.removeprefix('torch.')}:{list(shape)}")
    digest = int.from_bytes(hashlib.blake2b("\n".join(text).encode(), digest_size=8).digest(), "big") >> 1
    return [_PREAMBLE_MAGIC, len(names), total, digest]


def describe_preamble(values: list[int]) -> str:
    """A preamble in words, for errors."""
    if values[0] != _PREAMBLE_MAGIC:
        return f"no size preamble (first values {values[:3]})"
    return f"{values[1]} tensors, {values[2]} bytes (digest {values[3]:x})"


def local_address_towards(host: str, port: int) -> str:
    """The local IP this host uses to reach host:port (loopback for a loopback peer, the pod IP in a
    pod): what a weight-group listener binds, never all interfaces. No packet is sent."""
    import socket

    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        local: str = s.getsockname()[0]
    return local


def listening_store(bind: str, port: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """The master TCPStore of a group, listening on `bind`:`port` only.

    Why: torch's TCPStore server binds all interfaces (`::`, dual-stack) whatever host it is given;
    it only keeps to one address when it is handed a socket already bound and listening
    (`master_listen_fd`). The store takes the descriptor over and closes it when it is deleted, so the
    Python socket object is detached here (closing it too would close the store's listener).
    """
    import socket

    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind, port))
        sock.listen(1024)
        store = dist.TCPStore(  # type: ignore[attr-defined]
            bind, sock.getsockname()[1], world_size, is_master=True, timeout=timeout,
            master_listen_fd=sock.fileno(),
        )  # fmt: skip
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store


def open_weight_update_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    timeout_s: float = 300.0,
    join_timeout_s: float | None = None,
    announce_sizes: bool = False,
) -> WeightUpdateGroup:
    """Join (rank > 0) or host (rank 0) the weight-update group; blocks until all ranks joined.

    join_timeout_s bounds the rendezvous (default: timeout_s); timeout_s bounds each collective.
    announce_sizes: this rank sends (rank 0) or checks (an engine) the size preamble of every update
    (`size_preamble`); it is used when every rank of the group says so (WeightUpdateGroup.announces_sizes).
    Rank 0's listeners (the TCPStore, gloo's pairs) bind the local address that routes to
    master_address, never all interfaces; NCCL binds the address of its socket interface
    (NCCL_SOCKET_IFNAME; docs/security.md).
    """
    import torch
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: use gloo (CPU) or nccl (CUDA)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}; check rank_offset and world_size")
    if not 0 < master_port < 65536:
        raise ValueError(f"master_port {master_port}: must be in 1..65535")
    timeout = datetime.timedelta(seconds=timeout_s)
    join = datetime.timedelta(seconds=timeout_s if join_timeout_s is None else join_timeout_s)
    bind = local_address_towards(master_address, master_port)
    if rank == 0:
        store = listening_store(bind, master_port, world_size, join)
    else:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=join)  # type: ignore[attr-defined]
    prefixed = dist.PrefixStore(f"{group_name}/", store)  # type: ignore[attr-defined]
    if announce_sizes:  # before the group forms, so every rank sees it once the group exists
        prefixed.set(f"{PREAMBLE_KEY}/{rank}", "1")
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
        pg: Any = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("backend nccl needs CUDA; use gloo on CPU")
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, nccl_opts)
    store.set_timeout(timeout)
    return WeightUpdateGroup(
        name=group_name, backend=backend, rank=rank, world_size=world_size, pg=pg, store=store, keys=prefixed
    )
