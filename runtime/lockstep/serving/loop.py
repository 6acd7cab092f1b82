"""LoopThread: one asyncio event loop on a background thread, driven from synchronous code.

Why it exists: the async EngineClient is bound to the event loop it first ran on, while its callers are
synchronous: the driver's loop, readable top to bottom, and WeightTransport.update_weights, which issues blocking
collectives between steps. A LoopThread owns one such loop; synchronous code submits coroutines to it
from any thread, and HTTP calls run there concurrently with the collectives the calling thread issues
(the engine's /update_weights_from_distributed only returns after it received them).

Who calls it: lockstep.driver (one per run: components, transports, the fully-async loop) and
lockstep.weights (one per transport: broadcast, ipc, preflight, the disk-delta reload).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An asyncio loop running forever on a daemon thread until close()."""

    def __init__(self, name: str = "lockstep-aio") -> None:
        self.loop = asyncio.new_event_loop()
        """The loop every EngineClient submitted here is bound to."""
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule a coroutine; the returned future's result() re-raises its exception."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and return its result (blocks the calling thread)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run called from its own loop thread; await the coroutine instead")
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        """Cancel pending tasks, stop the loop and join the thread; idempotent."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():

            async def _cancel_all() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            self.submit(_cancel_all()).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        self.loop.close()
