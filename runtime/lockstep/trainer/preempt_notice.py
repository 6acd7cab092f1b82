"""A follower rank's SIGTERM reaches rank 0, so the group checkpoints before the follower is killed.

Why it exists: rank 0 checkpoints on its own SIGTERM (lockstep.trainer.server). On several nodes, a
drain may take only a follower's node: the follower cannot drain alone (every step and save is
collective) and used to ignore SIGTERM until the kubelet killed it, breaking the group mid-collective and
losing every step since the last save. Now the follower writes PREEMPT_KEY into the group's
torch.distributed store (the rendezvous TCPStore every rank shares) and keeps serving the collectives;
rank 0 watches for the key and drains exactly as on its own SIGTERM: the running command finishes, the
unsaved steps are checkpointed (collectively, the follower included), every rank exits.

The follower's main thread is usually blocked inside a gloo receive, where Python signal handlers do
not run, so the signal is seen through `signal.set_wakeup_fd` by a thread of its own.

Who calls it: lockstep.trainer.server (`serve`: followers call `notify_on_sigterm`, rank 0 `watch`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

PREEMPT_KEY = "lockstep/preempted"
"""Store key a follower sets on SIGTERM (its value: the rank)."""


def default_store() -> Any:
    """The torch.distributed default group's store (the rendezvous TCPStore), or None."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):  # not initialized: a single process
        return None


def notify_on_sigterm(store: Any, rank: int) -> threading.Event:
    """Followers: on SIGTERM, set PREEMPT_KEY in `store` (from a thread: the main thread may be inside a
    collective) and otherwise keep running until rank 0 releases this rank. The event returned is set
    once this rank got SIGTERM (its own stop was requested: lockstep.trainer.server.rank_exit)."""
    got = threading.Event()
    if store is None or threading.current_thread() is not threading.main_thread():
        return got
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def handler(signum: int, frame: Any) -> None:
        log.info("SIGTERM: rank 0 is told, checkpoints, then releases this rank")

    signal.signal(signal.SIGTERM, handler)
    signal.set_wakeup_fd(write_fd)

    def wait() -> None:
        while True:
            data = os.read(read_fd, 64)
            if signal.SIGTERM in data:
                got.set()
                try:
                    store.set(PREEMPT_KEY, str(rank))
                except Exception as e:  # rank 0 (the store's host) is gone already: nothing to tell
                    log.warning("could not tell rank 0 about SIGTERM: %s", e)
                return

    threading.Thread(target=wait, name="lockstep-preempt-notice", daemon=True).start()
    return got


async def watch(store: Any, on_notice: Callable[[], None], poll_s: float = 0.5) -> None:
    """Rank 0: call `on_notice` once a follower set PREEMPT_KEY (runs until cancelled)."""
    if store is None:
        return
    loop = asyncio.get_running_loop()
    while True:
        try:
            seen = await loop.run_in_executor(None, store.check, [PREEMPT_KEY])
        except Exception:  # the store went away: the group is ending anyway
            return
        if seen:
            rank = await loop.run_in_executor(None, store.get, PREEMPT_KEY)
            log.warning("rank %s got SIGTERM: draining and checkpointing", rank.decode() if rank else "?")
            on_notice()
            return
        await asyncio.sleep(poll_s)
