"""Client figure: rollout wall time of a wave of concurrent /generate calls, by keep-alive pool size.

Why it exists: EngineClient opens a connection per request (no idle keep-alives) because httpcore's
pool scans every pooled connection each time a request starts or ends; with a wave of concurrent
generates the scan, not the engine, dominated the rollout. This prints, for a wave of N six-token
generates to a real reference engine (builtin:tiny) on loopback, the median wall time per wave for
the shipped client and for the same client with a keep-alive pool of K idle connections (the
baseline), and their ratio, measured in the same run.

Run: `.venv/bin/python bench/engine_client_pool.py [--requests 64] [--waves 8] [--keepalive 256 16]`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.models.tiny import materialize_builtin
from lockstep.serving import EngineClient, SamplingParams

PROMPT = [2, 20, 21, 22, 23, 3, 5, 6, 7]


async def waves(path: Path, keepalive: int | None, requests: int, count: int) -> float:
    """Median seconds per wave; keepalive None = the client as shipped."""
    engine = ReferenceEngine.load(path, seed=0)
    server = TestServer(create_app(engine), host="127.0.0.1")
    await server.start_server()
    client = EngineClient(str(server.make_url("")).rstrip("/"))
    if keepalive is not None:
        await client.aclose()
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=keepalive)
        client._http = httpx.AsyncClient(timeout=60.0, limits=limits)
    times = []
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            await asyncio.gather(
                *(
                    client.generate(
                        PROMPT, SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=i)
                    )
                    for i in range(requests)
                )
            )
            times.append(time.perf_counter() - t0)
    finally:
        await client.aclose()
        await server.close()
    return statistics.median(times[1:])  # the first wave opens every connection in both cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--waves", type=int, default=8)
    ap.add_argument("--keepalive", type=int, nargs="+", default=[256, 16])
    args = ap.parse_args()
    path = materialize_builtin("builtin:tiny", Path(tempfile.mkdtemp()), seed=0)
    shipped = asyncio.run(waves(path, None, args.requests, args.waves))
    print(f"{args.requests} concurrent generates per wave, median of {args.waves - 1} waves")
    print(f"shipped client (no idle keep-alives): {shipped:.3f} s")
    for k in args.keepalive:
        pooled = asyncio.run(waves(path, k, args.requests, args.waves))
        print(f"keep-alive pool of {k}: {pooled:.3f} s -> shipped is {pooled / shipped:.1f}x faster")


if __name__ == "__main__":
    main()
