"""`lockstep engine`: serve the reference rollout engine (SGLang's HTTP API subset) on one port.

Why it exists: engine pods and local runs start the engine the same way:
`lockstep engine --model DIR|builtin:tiny --host 127.0.0.1 --port 30000 [--device cpu|cuda]`, and for
true on-policy SGLang's own `--enable-deterministic-inference --rl-on-policy-target fsdp`.
Binds to 127.0.0.1 unless --host says otherwise (in a pod: the pod IP). With --api-key (or
LOCKSTEP_API_KEY) every route but health and version reads needs the bearer key. SIGTERM drains for
--drain-timeout seconds, then exits even if a thread is stuck in a collective.

Who calls it: the rollout pods the operator creates, `lockstep run`, users.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time

import torch
from aiohttp import web

from lockstep.cli.commands import HELP
from lockstep.engine import ReferenceEngine, create_app
from lockstep.engine.server import MAX_BODY_BYTES
from lockstep.models import resolve_checkpoint
from lockstep.serving.client import API_KEY_ENV, api_key_from_env


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
        help="serve only what stock SGLang serves: no per-token versions, /engine_stats or P2P receive side",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every route but health and version reads "
        f"(SGLang's flag; default: ${API_KEY_ENV} when set)",
    )
    p.add_argument(
        "--max-queued-requests", type=int, default=1024, help="requests queued or running; more get 503"
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="request body cap (larger: 413)"
    )
    p.add_argument(
        "--weight-group-timeout",
        type=float,
        default=120.0,
        help="seconds a /init_weights_update_group rendezvous may take (default 120)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=20.0,
        help="on SIGTERM: seconds running requests may finish before they are aborted (default 20)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "bf16", "fp8_e4m3", "fp8_e5m2"],
        help="KV-cache dtype, SGLang's values (fp8: K/V stored in FP8 with scale 1.0)",
    )
    # True on-policy, with SGLang's own switches (lockstep.api.profiles.SGLANG_TRUE_ON_POLICY_ARGS).
    p.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant kernels and deterministic sampling logprobs (SGLang's switch)",
    )
    p.add_argument(
        "--rl-on-policy-target",
        default=None,
        choices=["fsdp"],
        help="run the FSDP trainer's numerics, bit for bit (true on-policy; needs the switch above)",
    )
    p.add_argument(
        "--attention-backend",
        default=None,
        help="accepted for SGLang compatibility; the reference engine's attention follows the mode",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.rl_on_policy_target and not args.enable_deterministic_inference:
        raise SystemExit("--rl-on-policy-target needs --enable-deterministic-inference (as in SGLang)")
    path = resolve_checkpoint(args.model, seed=args.seed)
    engine = ReferenceEngine.load(
        path,
        device=args.device,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        seed=args.seed,
        cuda_graphs=args.cuda_graphs,
        max_queued_requests=args.max_queued_requests,
        true_on_policy=args.rl_on_policy_target is not None,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine.set_weight_version(args.weight_version)
    app = create_app(
        engine,
        allow_tensor_updates=args.allow_tensor_updates,
        stock=args.stock,
        api_key=args.api_key or api_key_from_env(),
        max_body_bytes=args.max_body_bytes,
        weight_group_timeout_s=args.weight_group_timeout,
    )
    web.run_app(app, host=args.host, port=args.port, shutdown_timeout=args.drain_timeout)
    _exit_if_stuck()
    return 0


def _exit_if_stuck(grace_s: float = 2.0) -> None:
    """After SIGTERM's drain: a thread still blocked (the worker in a collective whose sender died)
    must not keep the pod alive past its grace period, so exit without joining it."""
    deadline = time.monotonic() + grace_s
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join(max(deadline - time.monotonic(), 0))
    stuck = [
        t.name
        for t in threading.enumerate()
        if t.is_alive() and not t.daemon and t is not threading.main_thread()
    ]
    if stuck:
        logging.getLogger(__name__).warning("exiting with threads still blocked: %s", ", ".join(stuck))
        logging.shutdown()
        os._exit(0)
