"""AsyncRunner: one asyncio event loop on a background thread, driven from synchronous code.

Why it exists: the loop of `lockstep run` is synchronous and readable top to bottom, while the engine
client (httpx) is asynchronous and bound to the event loop it first ran on. The runner owns that one
loop: every coroutine that touches an EngineClient goes through `runner.run(coro)`, from any thread
(the driver's main thread, a weight transport's reload callback). The fully-async loop may instead run
its whole body as one coroutine with `runner.run(main())`.

Who calls it: lockstep.driver (components, loop), lockstep.driver.fully_async.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class AsyncRunner:
    """A daemon thread running an event loop; `run` blocks until the coroutine is done."""

    def __init__(self, name: str = "lockstep-aio") -> None:
        self.loop = asyncio.new_event_loop()
        """The loop every EngineClient of the run is bound to."""
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and return its result (re-raising its exception)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("AsyncRunner.run called from its own loop thread; await the coroutine instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stop the loop and join the thread (pending tasks are cancelled)."""
        if not self._thread.is_alive():
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
