"""`lockstep engine`: serve the reference rollout engine (SGLang's HTTP API subset) on one port.

Why it exists: engine pods and local runs start the engine the same way:
`lockstep engine --model DIR|builtin:tiny --host 127.0.0.1 --port 30000 [--device cpu|cuda]`, and for
true on-policy SGLang's own `--enable-deterministic-inference --rl-on-policy-target fsdp`.
Binds to 127.0.0.1 unless --host says otherwise (in a pod: the pod IP). With --api-key (or
LOCKSTEP_API_KEY) every route but health and version reads needs the bearer key; --weights-root confines
/update_weights_from_disk to those directories. SIGTERM drains for
--drain-timeout seconds, then exits even if a thread is stuck in a collective.

Who calls it: the rollout pods the operator creates, `lockstep run`, users.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from functools import partial

import torch
from aiohttp import web

from lockstep.api import Precision
from lockstep.api.profiles import SGLANG_QUANTIZATION
from lockstep.cli.commands import HELP
from lockstep.engine import ReferenceEngine, create_app
from lockstep.engine.disk_reads import DISK_READ_TIMEOUT_S
from lockstep.engine.metrics import engine_registry
from lockstep.engine.server import MAX_BODY_BYTES, serving
from lockstep.models import CheckpointError, resolve_checkpoint
from lockstep.numerics.quant import Scheme
from lockstep.observability.metrics import metrics_port_from_env, serve_registry
from lockstep.serving.client import API_KEY_ENV, api_key_from_env


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("engine", help=HELP["engine"])
    p.add_argument(
        "--model",
        required=True,
        help="HF-layout checkpoint dir, hub repo id (org/name[@rev]) or builtin:<name>",
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
        "--allow-auto-truncate",
        action="store_true",
        help="cut a request beyond the context to fit instead of answering 400 (SGLang's flag; off "
        "by default, as in SGLang: the runtime's client asks only for what fits)",
    )
    p.add_argument(
        "--weights-root",
        action="append",
        default=None,
        metavar="DIR",
        help="a directory /update_weights_from_disk may read checkpoints from (repeatable; default: "
        "any directory, logged as a warning); the operator passes the job's shared volume",
    )
    p.add_argument(
        "--disk-read-timeout",
        type=float,
        default=DISK_READ_TIMEOUT_S,
        help=f"seconds reading one disk update's files may take (default {DISK_READ_TIMEOUT_S:.0f})",
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
    p.add_argument(
        "--quantization",
        default=None,
        choices=sorted(SGLANG_QUANTIZATION.values()),
        help="serving format, SGLang's values; must match the checkpoint's quantization_config (the "
        "reference engine dequantizes what the converted checkpoint holds)",
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
    # LoRA serving, with SGLang's flags: several adapters on the base, one per request (docs/lora.md).
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters on the base (lora_path)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank a load may have")
    p.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        help="module leaf names adapters may target (q_proj ...), or all (the default)",
    )
    p.add_argument("--max-loaded-loras", type=int, default=None, help="most adapters loaded at once")
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
    try:
        path = resolve_checkpoint(args.model, seed=args.seed)
    except CheckpointError as e:
        print(f"error: --model: {e}", file=sys.stderr)
        return 2
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
        allow_auto_truncate=args.allow_auto_truncate,
    )
    _check_quantization(args.quantization, engine.scheme)
    engine.set_weight_version(args.weight_version)
    if args.enable_lora or args.max_lora_rank is not None or args.lora_target_modules:
        if args.max_lora_rank is None:
            raise SystemExit("--enable-lora needs --max-lora-rank (the largest adapter rank to serve)")
        if engine.scheme is not None:
            raise SystemExit("--enable-lora with a quantized checkpoint is not built: serve the bf16 base")
        engine.enable_lora(
            max_rank=args.max_lora_rank,
            target_modules=args.lora_target_modules,
            max_loaded=args.max_loaded_loras,
        )
    app = create_app(
        engine,
        allow_tensor_updates=args.allow_tensor_updates,
        stock=args.stock,
        api_key=args.api_key or api_key_from_env(),
        max_body_bytes=args.max_body_bytes,
        weight_group_timeout_s=args.weight_group_timeout,
        weights_roots=args.weights_root,
        disk_read_timeout_s=args.disk_read_timeout,
    )
    metrics_port = metrics_port_from_env()
    if metrics_port:  # in a pod: the `metrics` port the operator declares (manifests/monitoring scrape it)
        serve_registry(engine_registry(engine, partial(serving, app)), metrics_port)
    if args.weights_root is None:
        logging.getLogger(__name__).warning(
            "/update_weights_from_disk reads any directory this process can; pass --weights-root to confine it"
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


def _check_quantization(flag: str | None, scheme: Scheme | None) -> None:
    """--quantization must say what the checkpoint holds (the reference engine does not quantize
    online: the exceptions of the job's recipe live in the converted checkpoint)."""
    held = None if scheme is None else SGLANG_QUANTIZATION[Precision(scheme.format.value)]
    if flag is not None and flag != held:
        raise SystemExit(
            f"--quantization {flag}: the checkpoint holds {held or 'unquantized weights'}; serve a checkpoint "
            "converted by the job's recipe (lockstep.numerics.recipe.convert_checkpoint) or drop the flag"
        )
