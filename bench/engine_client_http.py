"""Client figure: rollout wall time of a wave of concurrent /generate calls, by HTTP layer.

Why it exists: a rollout step sends one /generate per sample, so the client's cost per request is paid
hundreds of times a step, on the same cores (and GIL) as the engine and the trainer in a one-machine
run. EngineClient's HTTP layer is aiohttp with pooled keep-alive connections (lockstep.serving.http);
the baseline is the layer it replaced: httpx with a fresh connection per request (its pool scan made
keep-alive slower still, bench/results/engine_client_pool_2026-12-02_cpu.md). This prints, for a wave
of N six-token generates to a real reference engine (builtin:tiny) on loopback, the median wall time
per wave and the client process's CPU time per request for both, and their ratio, measured in the
same run.

Run: `.venv/bin/python bench/engine_client_http.py [--requests 128] [--waves 8]`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.models.tiny import materialize_builtin
from lockstep.serving import EngineClient, GenerateReply, GenerateRequest, SamplingParams

PROMPT = [2, 20, 21, 22, 23, 3, 5, 6, 7]

Generate = Callable[[int], Awaitable[object]]


def _request(i: int) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=i)
    return GenerateRequest(input_ids=PROMPT, sampling_params=sp, return_logprob=True, rid=f"r{i}")


async def _waves(generate: Generate, requests: int, count: int) -> tuple[float, float]:
    """(median wall s per wave, process CPU s per request) over waves 2..count (the first warms up)."""
    await asyncio.gather(*(generate(i) for i in range(requests)))
    walls = []
    cpu0 = time.process_time()
    for _ in range(count - 1):
        t0 = time.perf_counter()
        await asyncio.gather(*(generate(i) for i in range(requests)))
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls), (time.process_time() - cpu0) / ((count - 1) * requests)


async def measure(path: Path, layer: str, requests: int, count: int) -> tuple[float, float]:
    engine = ReferenceEngine.load(path, seed=0, max_running_requests=requests)
    server = TestServer(create_app(engine), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        if layer == "shipped":
            async with EngineClient(url) as client:

                async def shipped(i: int) -> object:
                    return await client.generate(PROMPT, _request(i).sampling_params)

                return await _waves(shipped, requests, count)
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60.0, limits=limits) as http:

            async def baseline(i: int) -> object:
                body = _request(i).model_dump(mode="json", exclude_none=True)
                resp = await http.post(url + "/generate", json=body)
                return GenerateReply.model_validate(resp.json())

            return await _waves(baseline, requests, count)
    finally:
        await server.close()
        await engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=128, help="concurrent generates per wave (one RL step)")
    ap.add_argument("--waves", type=int, default=8)
    args = ap.parse_args()
    path = materialize_builtin("builtin:tiny", Path(tempfile.mkdtemp()), seed=0)
    shipped, shipped_cpu = asyncio.run(measure(path, "shipped", args.requests, args.waves))
    base, base_cpu = asyncio.run(measure(path, "baseline", args.requests, args.waves))
    print(f"{args.requests} concurrent six-token generates per wave, median of {args.waves - 1} waves")
    print(
        f"baseline (httpx, a connection per request): {base:.3f} s/wave, {base_cpu * 1e3:.2f} ms CPU/request"
    )
    print(
        f"shipped (aiohttp, keep-alive):              {shipped:.3f} s/wave, {shipped_cpu * 1e3:.2f} ms CPU/request"
    )
    print(f"ratio baseline/shipped: {base / shipped:.2f}x wall, {base_cpu / shipped_cpu:.2f}x CPU")


if __name__ == "__main__":
    main()
