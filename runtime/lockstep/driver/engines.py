"""Engines for a local run: the reference engine served in-process, and round-robin over replicas.

Why it exists: `lockstep run` on one machine needs real rollout engines without a cluster. Each one is
the reference engine (lockstep.engine) behind its real aiohttp app, served on 127.0.0.1 on a free port
from a background thread with its own event loop, so the runtime reaches it over HTTP exactly as it
reaches SGLang. `PoolClient` spreads generate calls over several replicas (round-robin per call; all
samples of a sync batch are independent, so no affinity is needed).

Who calls it: lockstep.driver.components.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from lockstep.engine import ReferenceEngine, create_app

if TYPE_CHECKING:
    from lockstep.serving.client import EngineClient, GenerateResult
    from lockstep.serving.payloads import SamplingParams


@dataclass(slots=True)
class EngineServer:
    """An engine served by this process."""

    url: str
    """Base URL, http://127.0.0.1:<port>."""
    stop: Callable[[], None]
    """Shut the server down and join its thread."""
    engine: Any = None
    """The engine object (for tests and diagnostics)."""


def start_reference_engine(
    model_dir: Path,
    *,
    device: str = "cpu",
    allow_tensor_updates: bool = False,
    true_on_policy: bool = False,
    kv_cache_dtype: str = "auto",
) -> EngineServer:
    """Serve lockstep.engine's reference engine for `model_dir` on 127.0.0.1 (free port).

    `allow_tensor_updates` opens /update_weights_from_tensor (pickled tensors; the cuda-ipc transport).
    `true_on_policy` runs the trainer's batch-invariant kernels (spec.algorithm.trueOnPolicy);
    `kv_cache_dtype` is spec.rollout.kvCacheDtype (SGLang's values).

    Sampling is reproducible through the per-request sampling_seed the rollout sends, so the engine
    itself needs no seed.
    """
    started = threading.Event()
    state: dict[str, Any] = {}
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        engine = ReferenceEngine.load(
            model_dir, device=device, true_on_policy=true_on_policy, kv_cache_dtype=kv_cache_dtype
        )
        await engine.start()
        runner = web.AppRunner(create_app(engine, allow_tensor_updates=allow_tensor_updates), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        state.update(engine=engine, runner=runner, port=sockets[0].getsockname()[1])

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve())
        except BaseException as e:
            state["error"] = e
            started.set()
            return
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=main, name="lockstep-engine", daemon=True)
    thread.start()
    started.wait(120)
    if "error" in state:
        raise RuntimeError(f"reference engine failed to start on {model_dir}: {state['error']}") from state[
            "error"
        ]
    if "port" not in state:
        raise RuntimeError(f"reference engine on {model_dir} did not start within 120 s")

    def stop() -> None:
        if not thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop)
        try:
            fut.result(30)
        finally:
            asyncio.run_coroutine_threadsafe(state["engine"].close(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)

    return EngineServer(url=f"http://127.0.0.1:{state['port']}", stop=stop, engine=state["engine"])


class PoolClient:
    """A GenerateBackend over the pool's replicas (one EngineClient each), round-robin per generate call."""

    def __init__(self, clients: Sequence[EngineClient]) -> None:
        if not clients:
            raise ValueError("at least one engine is needed (spec.rollout.replicas >= 1 or an --engine-url)")
        self.clients = list(clients)
        """The replicas' clients."""
        self._next = itertools.cycle(range(len(self.clients)))

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        return_logprob: bool = True,
        logprob_start_len: int = -1,
        return_routed_experts: bool = False,
        rid: str | None = None,
    ) -> GenerateResult:
        client = self.clients[next(self._next)]
        return await client.generate(
            input_ids,
            sampling_params,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            return_routed_experts=return_routed_experts,
            rid=rid,
        )
