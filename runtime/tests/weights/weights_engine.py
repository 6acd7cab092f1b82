"""Helpers of the weight-transfer tests: a real reference engine served over HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path


class EngineServer:
    """A ReferenceEngine behind its aiohttp app on 127.0.0.1, on a private loop thread."""

    def __init__(
        self, model_dir: Path, *, device: str = "cpu", allow_tensor_updates: bool = False, stock: bool = False
    ) -> None:
        from aiohttp import web
        from lockstep.engine import ReferenceEngine, create_app

        self.engine = ReferenceEngine.load(model_dir, device=device)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        app = create_app(self.engine, allow_tensor_updates=allow_tensor_updates, stock=stock)
        self._runner = web.AppRunner(app)

        async def start() -> int:
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

        self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
