"""`lockstep sessions`: serve the TITO session server in front of one or more engine replicas.

Why it exists: in a cluster the session server runs as its own process (or a sidecar of the driver)
between agents and the rollout pool; agents point their OpenAI client at
http://HOST:PORT/sessions/{id}/v1 after creating a session with POST /sessions. Sessions stick to one
replica by consistent hashing of the session id (and the X-SMG-Routing-Key header for a router);
with --dp-size N they also stick to one of the replica's DP-attention ranks (routed_dp_rank).

Who calls it: the pods the operator creates, users, tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from pathlib import Path

from lockstep.api.auth import API_KEY_ENV, api_key_from_env
from lockstep.cli.commands import HELP
from lockstep.models import CheckpointError, resolve_tokenizer
from lockstep.models.families import names
from lockstep.rollout.session.engine import ReplicaPool
from lockstep.rollout.session.server import SessionServer, SessionServerConfig


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "sessions",
        help=HELP["sessions"],
        description="Serve the TITO session server: OpenAI-compatible chat per session, token-exact samples.",
    )
    parser.add_argument(
        "--engine",
        action="append",
        required=True,
        metavar="URL",
        help="engine replica or router base URL (repeat for several replicas), e.g. http://127.0.0.1:30000",
    )
    parser.add_argument("--family", required=True, help="model family: tiny, qwen3, glm47 or glm5")
    parser.add_argument(
        "--tokenizer",
        metavar="MODEL",
        help="the served model: its checkpoint dir (tokenizer.json), hub repo id or builtin:<name>; "
        "required for real qwen3/glm47/glm5 models",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8300, help="port (default 8300; 0 picks a free one)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=256, help="reply budget when a request names none"
    )
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="temperature when a request names none"
    )
    parser.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help="DP-attention ranks per replica (the engines' --dp-size); above 1 each session is pinned "
        "to one rank with routed_dp_rank (default 1: the engine picks)",
    )
    parser.add_argument("--r3", action="store_true", help="capture routed experts (R3) on every turn")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every route but /metrics (default: ${API_KEY_ENV})",
    )
    parser.add_argument("--max-sessions", type=int, default=4096, help="open sessions (more get 503)")
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20, help="request body cap (413)")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=20.0,
        help="on SIGTERM: seconds running requests may finish (new ones get 503) before they are cut off "
        "(default 20)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.family.removeprefix("builtin:") not in names():
        print(f"--family {args.family!r} is unknown; choose one of {', '.join(names())}")
        return 2
    if args.family in ("qwen3", "glm47", "glm5") and not args.tokenizer:
        print(
            f"warning: --family {args.family} without --tokenizer uses the offline stand-in vocabulary; "
            "its token IDs do not match a real model (pass the model's checkpoint dir)",
            flush=True,
        )
    if args.dp_size < 1:
        print(f"--dp-size {args.dp_size} is invalid; give the engines' --dp-size (1 or more)")
        return 2
    try:
        tokenizer_dir = resolve_tokenizer(args.tokenizer, Path(".")) if args.tokenizer else None
    except CheckpointError as e:
        print(f"error: --tokenizer: {e}")
        return 2
    config = SessionServerConfig(
        family=args.family,
        tokenizer_dir=str(tokenizer_dir) if tokenizer_dir else None,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        capture_routing=args.r3,
        api_key=args.api_key or api_key_from_env(),
        max_sessions=args.max_sessions,
        max_body_bytes=args.max_body_bytes,
    )

    async def serve() -> None:
        server = SessionServer(config, ReplicaPool(args.engine, dp_size=args.dp_size))
        url = await server.start(args.host, args.port)
        print(f"session server on {url} -> {', '.join(args.engine)}", flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        try:
            await stop.wait()
            print(f"SIGTERM: draining {server.in_flight} running request(s)", flush=True)
            if not await server.drain(args.drain_timeout):
                print(f"cut off requests still running after {args.drain_timeout:.0f} s", file=sys.stderr)
        finally:
            await server.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0
