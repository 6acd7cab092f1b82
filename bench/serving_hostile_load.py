"""Load figure: the reference engine under N concurrent clients mixing valid and hostile requests.

Why it exists: the engine promises that one bad request never fails another and that nothing is lost under
load. This drives a real reference engine (builtin:tiny, the job's key required, queue cap 64, body
cap 1 MiB, a weight root) on loopback with N clients, each sending a bounded number of requests, one
in four of them hostile (rotating: overflowing top_k, a 64-bit-overflowing seed, a token outside the
vocabulary, deeply nested JSON, a 2 MiB body, no key, a negative weight version, a batch beyond the
queue, temperature 1e-40 and top_p 1e-300 (zero in float32), a request beyond the context, weights
from a FIFO and from outside the weight root). It prints requests served, errors by kind (expected status per kind), p50/p99 latency of the
valid requests, and checks that nothing is lost: every valid request finished with its full token
budget, every hostile one got its status, no engine step failed, weights and version unchanged.
The baseline, measured in the same run, is the same valid requests (the hostile slots left empty);
the ratio is the valid p50/p99 under attack over the baseline.

Run: `.venv/bin/python bench/serving_hostile_load.py [--clients 16] [--requests 24] [--max-seconds 600]`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.models.tiny import materialize_builtin

KEY = "bench-key"
PROMPT = [2, 20, 21, 22, 23, 3, 5, 6, 7]
NEW_TOKENS = 8

HOSTILE: list[tuple[str, str, Any, dict[str, str] | None, int]] = [
    # (kind, path, body, headers (None: the key), expected status)
    ("top_k 2**70", "/generate", {"input_ids": PROMPT, "sampling_params": {"top_k": 2**70}}, None, 400),
    (
        "seed 2**70",
        "/generate",
        {"input_ids": PROMPT, "sampling_params": {"sampling_seed": 2**70}},
        None,
        400,
    ),
    ("token outside vocab", "/generate", {"input_ids": [10**9]}, None, 400),
    ("nested JSON", "/generate", b'{"input_ids": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None, 400),
    ("2 MiB body", "/generate", b"[" + b"1," * (1 << 20) + b"1]", None, 413),
    ("no key", "/update_weight_version", {"new_version": "99"}, {}, 401),
    ("negative version", "/update_weight_version", {"new_version": "-5"}, None, 400),
    ("batch beyond queue", "/generate", {"input_ids": [PROMPT] * 65}, None, 400),
    # found later: values that float32 cannot carry (they used to abort every request of their step),
    # a request beyond the context (stock SGLang's 400), weights read from a FIFO (used to hang the
    # engine) and from outside the weight root
    (
        "temperature 1e-40",
        "/generate",
        {"input_ids": PROMPT, "sampling_params": {"temperature": 1e-40}},
        None,
        400,
    ),
    ("top_p 1e-300", "/generate", {"input_ids": PROMPT, "sampling_params": {"top_p": 1e-300}}, None, 400),
    (
        "beyond the context",
        "/generate",
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10**6}},
        None,
        400,
    ),
    ("weights from a FIFO", "/update_weights_from_disk", {"model_path": "@FIFO"}, None, 400),
    ("weights outside the root", "/update_weights_from_disk", {"model_path": "/etc"}, None, 400),
]


def _digest(engine: ReferenceEngine) -> str:
    h = hashlib.sha256()
    for name, t in sorted(engine.named_weights().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


async def _client(
    url: str, index: int, requests: int, hostile: bool, out: dict[str, Any], deadline: float
) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        for i in range(requests):
            if time.monotonic() > deadline:
                out["not sent (time bound)"] += 1
                continue
            if i % 4 == 3 and not hostile:
                continue  # the baseline leaves the hostile slots empty: the same valid requests
            if i % 4 == 3:
                kind, path, body, headers, status = HOSTILE[(index + i // 4) % len(HOSTILE)]
                if isinstance(body, dict) and body.get("model_path") == "@FIFO":
                    body = {"model_path": out["fifo_dir"]}
                kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
                r = await http.post(path, headers=auth if headers is None else headers, **kw)
                key = f"{kind} -> {r.status_code}" + (
                    "" if r.status_code == status else f" (expected {status})"
                )
                out["hostile"][key] += 1
                continue
            body = {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "sampling_seed": i},
            }
            t0 = time.perf_counter()
            r = await http.post("/generate", json=body, headers=auth)
            seconds = time.perf_counter() - t0
            if r.status_code == 503:
                out["valid -> 503 (queue full, retry)"] += 1
                continue
            reply = r.json() if r.status_code == 200 else {}
            meta = reply.get("meta_info", {})
            if (
                r.status_code == 200
                and meta["finish_reason"]["type"] == "length"
                and len(reply["output_ids"]) == NEW_TOKENS
            ):
                out["valid served"] += 1
                out["latency"].append(seconds)
            else:
                out[f"valid LOST: {r.status_code} {str(reply)[:120]}"] += 1


async def _run(path: Path, clients: int, requests: int, hostile: bool, max_seconds: float) -> dict[str, Any]:
    engine = ReferenceEngine.load(path, seed=0, max_running_requests=16, max_queued_requests=64)
    root = Path(tempfile.mkdtemp(prefix="weights-root-"))
    fifo_dir = root / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "model.safetensors")  # nobody writes: a read would block forever
    app = create_app(engine, api_key=KEY, max_body_bytes=1 << 20, weights_roots=[root])
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    out: dict[str, Any] = collections.defaultdict(int)
    out["hostile"] = collections.Counter()
    out["latency"] = []
    out["fifo_dir"] = str(fifo_dir)
    before = (_digest(engine), engine.weight_version)
    warm: dict[str, Any] = collections.defaultdict(
        int, hostile=collections.Counter(), latency=[], fifo_dir=str(fifo_dir)
    )
    await asyncio.gather(
        *(_client(url, c, 3, False, warm, time.monotonic() + max_seconds) for c in range(clients))
    )
    deadline = time.monotonic() + max_seconds  # measured from here, after one warm-up wave
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(_client(url, c, requests, hostile, out, deadline) for c in range(clients)))
    finally:
        out["wall_s"] = time.perf_counter() - t0
        out["unchanged"] = (_digest(engine), engine.weight_version) == before
        out["failed_steps"] = engine.stats.failed_steps
        await server.close()
    return out


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) >= 2 else (xs[0] if xs else float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=24, help="requests per client")
    ap.add_argument("--max-seconds", type=float, default=600.0, help="bound on each phase")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = materialize_builtin("builtin:tiny", Path(tmp), seed=0)
        base = asyncio.run(_run(path, args.clients, args.requests, False, args.max_seconds))
        load = asyncio.run(_run(path, args.clients, args.requests, True, args.max_seconds))
    sent_valid = args.clients * (args.requests - args.requests // 4)
    print(f"{args.clients} clients x {args.requests} requests; hostile: 1 in 4 of the loaded run")
    for name, r in (("baseline (valid only)", base), ("under hostile load", load)):
        lat = r["latency"]
        print(f"\n{name}: wall {r['wall_s']:.1f} s, valid served {r['valid served']}, "
              f"p50 {_pct(lat, 50) * 1e3:.0f} ms, p99 {_pct(lat, 99) * 1e3:.0f} ms, "
              f"failed steps {r['failed_steps']}, weights+version unchanged {r['unchanged']}")  # fmt: skip
        for k, v in sorted(r.items()):
            if (k.startswith("valid") and k != "valid served") or k == "not sent (time bound)":
                print(f"  {k}: {v}")
        for k, v in sorted(r["hostile"].items()):
            print(f"  hostile {k}: {v}")
    lost = [k for r in (base, load) for k in r if k.startswith("valid LOST") or "expected" in str(k)]
    lost += [k for k in load["hostile"] if "expected" in k]
    ratio50 = _pct(load["latency"], 50) / _pct(base["latency"], 50)
    ratio99 = _pct(load["latency"], 99) / _pct(base["latency"], 99)
    print(f"\nvalid requests sent under load: {sent_valid}; served {load['valid served']}")
    print(f"ratio to baseline: p50 x{ratio50:.2f}, p99 x{ratio99:.2f}")
    ok = not lost and load["unchanged"] and load["failed_steps"] == 0
    print("nothing lost" if ok else f"LOST: {lost}")


if __name__ == "__main__":
    main()
