"""A private event loop on a background thread, so synchronous transports can drive async engine clients.

Why it exists: WeightTransport.push is synchronous (the trainer's ranks call it between steps, and the
collectives it issues block), while lockstep.serving.EngineClient is async. Each transport owns one
`LoopThread` and submits its HTTP calls there: they run concurrently with the broadcasts the calling
thread issues (the engine's /update_weights_from_distributed only returns after it received them).

Who calls it: broadcast.py, ipc.py, preflight.py, disk_delta.py (http_reload).
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

    def __init__(self, name: str = "weights-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule a coroutine; the returned future's result() re-raises its exception."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine to completion and return its result (blocks the calling thread)."""
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()
