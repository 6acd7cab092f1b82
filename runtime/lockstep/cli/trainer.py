"""`lockstep trainer --config job.yaml [--serve]`: a trainer rank (run under torchrun on every rank pod).

Why it exists: the TrainerGroup's ranks own the policy of a cluster job. The operator starts
`torchrun -m lockstep trainer --config /etc/lockstep/job.yaml --serve` on each rank pod; rank 0
serves the driver's commands on --port (lockstep.trainer.server) and every rank runs each one. Weight
updates go to every engine of the pool: --engine-url, else each address of the headless Service
LOCKSTEP_ENGINES_SERVICE (asked again before every update), else LOCKSTEP_ROUTER_URL. Checkpoints go
under --out and carry the driver's loop state. `auto` transport is resolved from --transport-file
(the operator's choice). Without --serve it only proves the sharded load / SFT / save path.
docs/trainer.md explains it all.

Exit codes (--serve): 0 shut down by the driver, 2 bad manifest, settings, checkpoint or transport
file, 3 no engine reachable or no transport file in time. A rank that cannot start (exit 2) writes its
error into the job's progress ConfigMap under `rank-<RANK>.json`, so the job fails with the reason.

Who calls it: trainer rank pods; tests (world size 1 and 2 with gloo).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lockstep.api import TRANSPORT_KEY, ManifestError, RLJob, load_manifest
from lockstep.api.auth import API_KEY_ENV, api_key_from_env
from lockstep.api.progress import rank_key
from lockstep.cli.commands import HELP
from lockstep.driver.report import START_FAILURES, reporter_from_env, start_failure
from lockstep.models import load_tokenizer, resolve_checkpoint
from lockstep.models.hub_data import resolve_data
from lockstep.observability.logs import configure_logging
from lockstep.serving.client import EngineUnreachable
from lockstep.serving.membership import members_from
from lockstep.tasks import data_task
from lockstep.train.common.losses import sft_loss
from lockstep.train.common.packing import pack_sft
from lockstep.train.factory import build_backend
from lockstep.trainer.local import SFT_ITEM_BASE
from lockstep.trainer.server import DRAIN_TIMEOUT_S, serve
from lockstep.trainer.settings import TrainerSettings

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
    try:
        job = load_manifest(args.config)
    except (ManifestError, FileNotFoundError) as e:
        print(f"error: {args.config}: {e}", file=sys.stderr)
        if args.serve:
            report_start_failure(e)
        return 2
    if args.serve:
        return serve_rank(job, args)
    return run_rank(job, args)


def serve_rank(job: RLJob, args: argparse.Namespace) -> int:
    """This rank of a serving trainer group (see the module docstring); exit code."""
    configure_logging()
    members = members_from(args.engine_url, os.environ)
    if members is None:
        print(
            "error: no engine: pass --engine-url or set LOCKSTEP_ENGINES_SERVICE (or LOCKSTEP_ROUTER_URL)",
            file=sys.stderr,
        )
        return 2
    listening: list[int] = []
    try:
        return serve(
            job,
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


def run_rank(job: RLJob, args: argparse.Namespace) -> int:
    """Join, load sharded, optionally SFT, save; prints one summary line on rank 0."""
    s = TrainerSettings.from_job(job)
    model_dir = resolve_checkpoint(job.spec.model.checkpoint, cache_dir=args.cache_dir, seed=s.seed)
    tok = load_tokenizer(model_dir, job.spec.model.tokenizer, job.spec.model.chat_template, args.cache_dir)
    task = data_task(resolve_data(job.spec.data))
    lr = s.sft_learning_rate or s.learning_rate
    backend = build_backend(
        job, model_dir, lr=lr, grad_clip=s.grad_clip, micro_batch_size=s.micro_batch_size, seed=s.seed
    )
    try:
        want = job.spec.trainer.nodes * job.spec.trainer.gpus_per_node
        if backend.world_size != want and backend.rank == 0:
            print(
                f"warning: world size {backend.world_size} != trainer.nodes x gpusPerNode = {want}",
                file=sys.stderr,
            )
        steps = args.sft_steps if args.sft_steps is not None else s.sft_steps
        rows = s.sft_rows
        loss = float("nan")
        for k in range(steps):
            # Each rank trains on its own slice of the global batch (data parallel over FSDP shards).
            idx = range(
                SFT_ITEM_BASE + k * rows + backend.rank, SFT_ITEM_BASE + (k + 1) * rows, backend.world_size
            )
            pairs = []
            for i in idx:
                item = task.item(i, "train")
                pairs.append(
                    (
                        tok.render(item.messages, add_generation_prompt=True),
                        [*tok.encode(item.answer), tok.eos_token_id],
                    )
                )
            loss = backend.train_step(pack_sft(pairs, tok.pad_token_id), sft_loss).loss
        backend.save(args.out, extra={"sft_steps": steps})
        if backend.rank == 0:
            print(
                f"trainer: world size {backend.world_size}, {steps} SFT steps, last loss {loss:.4f}, saved {args.out}"
            )
    finally:
        backend.close()
    return 0
