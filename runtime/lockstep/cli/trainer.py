"""`lockstep trainer --config job.yaml [--serve]`: a trainer rank (run under torchrun on every rank pod).

Why it exists: the TrainerGroup's ranks own the policy of a cluster job. The operator starts
`torchrun -m lockstep trainer --config /etc/lockstep/job.yaml --serve` on each rank pod; rank 0
serves the driver's commands on --port (lockstep.trainer.server) and every rank runs each one. Weight
updates go to every engine of the pool: --engine-url, else each address of the headless Service
LOCKSTEP_ENGINES_SERVICE (asked again before every update), else LOCKSTEP_ROUTER_URL. Checkpoints go
under --out and carry the driver's loop state. `auto` transport is resolved from --transport-file
(the operator's choice). Without --serve it only proves the sharded load / SFT / save path.
docs/trainer.md explains it all.

Exit codes (--serve): 0 shut down by the driver, or stopped by its own SIGTERM, 2 bad manifest,
settings, checkpoint or transport file, 3 no engine reachable or no transport file in time, 4 its
group stopped before the driver's shutdown without its own SIGTERM (a peer rank's pod deleted or its
node drained: the job is not done, so the pod must not end Succeeded; under `lockstep launch` torchrun
reports the worker's failure and exits 1). A rank that cannot start (exit 2) writes its error into the
job's progress ConfigMap under `rank-<RANK>.json`, so the job fails with the reason.

Who calls it: trainer rank pods; tests (world size 1 and 2 with gloo).
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lockstep.api import TRANSPORT_KEY, ManifestError, RLJob, load_manifest
from lockstep.api.auth import API_KEY_ENV, api_key_from_env
from lockstep.api.progress import rank_key
from lockstep.cli.commands import HELP
from lockstep.config.trainer import trainer_config, with_transport
from lockstep.observability.logs import configure_logging
from lockstep.progress import START_FAILURES, reporter_from_env, start_failure
from lockstep.serving.client import EngineUnreachable
from lockstep.serving.membership import StaticMembers, members_from
from lockstep.trainer.server import DRAIN_TIMEOUT_S, serve
from lockstep.trainer.settings import TrainerConfig
from lockstep.trainer.standalone import sft_and_save

DEFAULT_PORT = 29600
"""The trainer's command port (rank 0); the driver pod's LOCKSTEP_TRAINER_URL points at it."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("trainer", help=HELP["trainer"], description=__doc__)
    p.add_argument("--config", type=Path, required=True, help="rendered RLJob (job.yaml)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("LOCKSTEP_RUN_DIR", "/var/lib/lockstep/run")) / "trainer",
    )
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="where builtin:<name> checkpoints are written"
    )
    p.add_argument("--sft-steps", type=int, default=None, help="override the SFT warm-start steps")
    p.add_argument(
        "--serve",
        action="store_true",
        help="take the RL steps for a remote driver: rank 0 serves commands on --port, all ranks run them",
    )
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"command port of rank 0 (default {DEFAULT_PORT})"
    )
    p.add_argument(
        "--host",
        default=os.environ.get("POD_IP") or "127.0.0.1",
        help="address rank 0 listens on (default: $POD_IP in a pod, else 127.0.0.1; never all interfaces)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every command (default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=256 << 20,
        help="command body cap (a train batch is JSON; larger bodies get 413)",
    )
    p.add_argument(
        "--engine-url",
        action="append",
        default=[],
        help="an engine whose weights the ranks update, repeatable (default: every address of "
        "$LOCKSTEP_ENGINES_SERVICE on port 30000, else $LOCKSTEP_ROUTER_URL)",
    )
    p.add_argument("--engine-timeout", type=float, default=300.0, help="seconds to wait for the engines")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=DRAIN_TIMEOUT_S,
        help=f"on SIGTERM (--serve): seconds the running command may take before rank 0 exits without it "
        f"(default {DRAIN_TIMEOUT_S:.0f})",
    )
    p.add_argument(
        "--transport-file",
        type=Path,
        default=None,
        help="the operator's transport choice that resolves spec.weightSync.transport auto (default: "
        "transport.json next to --config, i.e. /etc/lockstep/transport.json in a rank pod)",
    )
    p.add_argument(
        "--transport-timeout",
        type=float,
        default=300.0,
        help="seconds a rank pod (LOCKSTEP_ROLE=trainer) waits for --transport-file when the spec says auto",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    return end_worker(_run(args))


def end_worker(code: int, env: Mapping[str, str] | None = None) -> int:
    """Under torchrun, end this worker's process here with `code`, after Python's own exit steps (its
    thread shutdown: idle pool workers woken, non-daemon threads joined; the atexit handlers; the logs
    and streams flushed) but without the interpreter's C++ teardown: torch's static destructors at
    exit sometimes abort a rank that had shut down cleanly ("terminate called without an active
    exception", SIGABRT; seen in CI after the driver's shutdown), and torchrun then reports the whole
    group as failed. Elsewhere (a test that calls the command in its own process) the code is returned."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env:
        return code
    # The interpreter's own first exit step: wake the thread pools' idle workers, join non-daemon threads
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(args: argparse.Namespace) -> int:
    try:
        job = load_manifest(args.config)
    except (ManifestError, FileNotFoundError) as e:
        print(f"error: {args.config}: {e}", file=sys.stderr)
        if args.serve:
            report_start_failure(e)
        return 2
    if args.serve:
        return serve_rank(job, args)
    return run_rank(trainer_config(job), args)


def serve_rank(job: RLJob, args: argparse.Namespace) -> int:
    """This rank of a serving trainer group (see the module docstring); exit code. `job` is read
    only through lockstep.config.trainer (and again with the operator's transport choice)."""
    configure_logging()
    config = trainer_config(job)
    members = members_from(args.engine_url, os.environ)
    if members is None and config.settings.sft_job:
        members = StaticMembers(())  # an SFT job has no engines
    if members is None:
        print(
            "error: no engine: pass --engine-url or set LOCKSTEP_ENGINES_SERVICE (or LOCKSTEP_ROUTER_URL)",
            file=sys.stderr,
        )
        return 2
    listening: list[int] = []
    try:
        return serve(
            config,
            out=args.out,
            members=members,
            host=args.host,
            port=args.port,
            cache_dir=args.cache_dir,
            engine_timeout_s=args.engine_timeout,
            transport_file=args.transport_file or args.config.parent / TRANSPORT_KEY,
            transport_timeout_s=args.transport_timeout,
            in_pod=os.environ.get("LOCKSTEP_ROLE") == "trainer",
            api_key=args.api_key or api_key_from_env(),
            max_body_bytes=args.max_body_bytes,
            drain_timeout_s=args.drain_timeout,
            on_listening=lambda port: _listening(listening, args.host, port),
            retransport=lambda transport: trainer_config(with_transport(job, transport)),
        )
    except (EngineUnreachable, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except START_FAILURES as e:
        print(f"error: {e}", file=sys.stderr)
        if not listening:
            report_start_failure(e)
        return 2


def _listening(ports: list[int], host: str, port: int) -> None:
    ports.append(port)
    logging.getLogger("lockstep.trainer").info("listening on %s:%d", host, port)


def report_start_failure(error: BaseException, env: Mapping[str, str] | None = None) -> bool:
    """Report that this rank (torchrun's RANK) cannot start, into the job's progress ConfigMap under
    `rank-<RANK>.json` (a rank pod's ServiceAccount may patch it); nowhere outside a pod."""
    env = os.environ if env is None else env
    rank = int(env.get("RANK", "0"))
    reporter = reporter_from_env(env, key=rank_key(rank))
    return reporter.report(start_failure(error, f"trainer rank {rank}"))


def run_rank(config: TrainerConfig, args: argparse.Namespace) -> int:
    """Without --serve: join, load sharded, optionally SFT, save (lockstep.trainer.standalone)."""
    sft_and_save(config, args.out, cache_dir=args.cache_dir, steps=args.sft_steps)
    return 0
