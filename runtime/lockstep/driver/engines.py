"""Engines for a local run: the reference engine served in-process, and round-robin over replicas.

Why it exists: `lockstep run` on one machine needs real rollout engines without a cluster. Each one is
the reference engine (lockstep.engine) behind its real aiohttp app, served on 127.0.0.1 on a free port
from a background thread with its own event loop, so the runtime reaches it over HTTP exactly as it
reaches SGLang; `start_engines` starts a run's replicas from its EngineSetup, `wait_for_engines` waits
until the run's engines (local or a cluster's) serve. `PoolClient` spreads generate calls over several replicas (round-robin per call; all
samples of a sync batch are independent, so no affinity is needed).

Who calls it: lockstep.driver.components, lockstep.cli.precision.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.engine import ReferenceEngine, create_app
from lockstep.engine.handoff import EngineHandoff
from lockstep.numerics.recipe import convert_checkpoint
from lockstep.serving.client import EngineUnreachable
from lockstep.serving.listen import listen
from lockstep.serving.membership import ENGINE_PORT, ENGINES_SERVICE_ENV, ServiceMembers, wait_for_serving

if TYPE_CHECKING:
    from lockstep.config.driver import EngineSetup
    from lockstep.numerics.recipe import Recipe
    from lockstep.serving.client import EngineClient, GenerateResult
    from lockstep.serving.loop import LoopThread
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
    handoff: EngineHandoff | None = None
    """Loads the trainer's tensors into this engine in memory (the in-process weight transport)."""


def start_reference_engine(
    model_dir: Path,
    *,
    device: str = "cpu",
    allow_tensor_updates: bool = False,
    true_on_policy: bool = False,
    kv_cache_dtype: str = "auto",
    max_lora_rank: int | None = None,
    api_key: str | None = None,
) -> EngineServer:
    """Serve lockstep.engine's reference engine for `model_dir` on 127.0.0.1 (free port).

    `allow_tensor_updates` opens /update_weights_from_tensor (pickled tensors; the cuda-ipc transport).
    `true_on_policy` runs the trainer's batch-invariant kernels (spec.algorithm.trueOnPolicy);
    `kv_cache_dtype` is spec.rollout.kvCacheDtype (SGLang's values); `max_lora_rank` serves LoRA
    adapters up to that rank (SGLang's --enable-lora --max-lora-rank; a LoRA job's engines); `api_key`
    is required as a bearer token on every route but the open reads (SGLang's --api-key).

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
        if max_lora_rank is not None:
            engine.enable_lora(max_rank=max_lora_rank)
        await engine.start()
        runner, port = await listen(
            create_app(engine, allow_tensor_updates=allow_tensor_updates, api_key=api_key), "127.0.0.1", 0
        )
        state.update(engine=engine, runner=runner, port=port)

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

    url = f"http://127.0.0.1:{state['port']}"
    return EngineServer(
        url=url, stop=stop, engine=state["engine"], handoff=EngineHandoff(state["engine"], loop, url)
    )


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
        lora_path: str | None = None,
    ) -> GenerateResult:
        client = self.clients[next(self._next)]
        return await client.generate(
            input_ids,
            sampling_params,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            return_routed_experts=return_routed_experts,
            rid=rid,
            lora_path=lora_path,
        )


def start_engines(
    setup: EngineSetup, model_dir: Path, closers: list[Callable[[], None]]
) -> list[EngineServer]:
    """setup.replicas reference engines in this process (CUDA when gpusPerEngine > 0 and present).

    They accept tensor updates only when the transport is cuda-ipc (the restricted unpickler is the
    only door for pickled tensors, so it stays shut otherwise)."""
    device = engine_device(setup)
    engines = []
    for _ in range(setup.replicas):
        server = start_reference_engine(
            model_dir,
            device=device,
            allow_tensor_updates=setup.allow_tensor_updates,
            true_on_policy=setup.true_on_policy,
            kv_cache_dtype=setup.kv_cache_dtype,
            max_lora_rank=setup.max_lora_rank,
        )
        closers.append(server.stop)
        engines.append(server)
    return engines


def engine_device(setup: EngineSetup) -> str:
    """Where this process's reference engines run: CUDA when gpusPerEngine > 0 and present."""
    return "cuda" if setup.wants_gpu and cuda_available() else "cpu"


def serving_checkpoint(serving: Recipe | None, model_dir: Path, run_dir: Path) -> Path:
    """The checkpoint the engines load: `model_dir`, or with a serving recipe (spec.rollout.precision
    other than bf16) its conversion by that recipe (§6 stage 1) under run_dir/serving-<precision>."""
    if serving is None:
        return model_dir
    return convert_checkpoint(model_dir, run_dir / f"serving-{serving.scheme.format}", serving)


def wait_for_engines(
    runner: LoopThread, clients: list[EngineClient], timeout_s: float, *, cluster: bool
) -> None:
    """Wait until the engines serve. In a cluster (a driver pod: LOCKSTEP_ENGINES_SERVICE and a trainer
    group) the router Service lists only engines at the job's current weight version (their readiness
    gate), and a (re)started driver establishes that version only with its first update: waiting for
    the router first deadlocked a driver restarted after its engine was replaced (found on the real
    node). So it waits for any engine of the pool's headless Service here, and for the router right
    after the first update (steps.start)."""
    service = os.environ.get(ENGINES_SERVICE_ENV)
    if cluster and service:
        try:
            wait_for_serving(ServiceMembers(service, ENGINE_PORT), timeout_s)
        except TimeoutError as e:
            raise EngineUnreachable(f"http://{service}:{ENGINE_PORT}/health", 1, e) from e
        return
    for client in clients:
        runner.run(client.wait_ready(timeout_s=timeout_s))


def close_clients(runner: LoopThread, clients: list[EngineClient]) -> None:
    for client in clients:
        runner.run(client.aclose())


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())
