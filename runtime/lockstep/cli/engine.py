"""`lockstep engine`: serve the reference rollout engine (SGLang's HTTP API subset) on one port.

Why it exists: engine pods and local runs start the engine the same way:
`lockstep engine --model DIR|builtin:tiny --host 127.0.0.1 --port 30000 [--device cpu|cuda]`.
Binds to 127.0.0.1 unless --host says otherwise.

Who calls it: the rollout pods the operator creates, `lockstep run`, users.
"""

from __future__ import annotations

import argparse
import logging

import torch
from aiohttp import web

from lockstep.cli.commands import HELP
from lockstep.engine import ReferenceEngine, create_app
from lockstep.models.tiny import resolve_checkpoint


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("engine", help=HELP["engine"])
    p.add_argument(
        "--model", required=True, help="HF-layout checkpoint dir, or builtin:tiny / builtin:bigger"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port (default 30000)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run (default cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="weights dtype")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, and init seed of builtin models")
    p.add_argument("--max-running-requests", type=int, default=32, help="KV slots: sequences run together")
    p.add_argument("--context-length", type=int, default=None, help="longest prompt+output in tokens")
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="capture decode steps into CUDA graphs (default: on with --device cuda)",
    )
    p.add_argument(
        "--allow-tensor-updates",
        action="store_true",
        help="enable /update_weights_from_tensor (unpickles request data: trusted networks only)",
    )
    p.add_argument("--weight-version", type=int, default=0, help="version reported for the loaded weights")
    p.add_argument(
        "--stock",
        action="store_true",
        help="serve only what stock SGLang serves: no /engine_stats, no P2P receive side",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = resolve_checkpoint(args.model, seed=args.seed)
    engine = ReferenceEngine.load(
        path,
        device=args.device,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        seed=args.seed,
        cuda_graphs=args.cuda_graphs,
    )
    engine.set_weight_version(args.weight_version)
    web.run_app(
        create_app(engine, allow_tensor_updates=args.allow_tensor_updates, stock=args.stock),
        host=args.host,
        port=args.port,
    )
    return 0
