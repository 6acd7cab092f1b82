"""`lockstep driver --config job.yaml`: the driver pod's entry point.

Why it exists: in a cluster the operator renders the RLJob into /etc/lockstep/job.yaml and starts a
driver pod with LOCKSTEP_ROUTER_URL pointing at the rollout pool's router; this runs the same loop
as `lockstep run` against that URL. With --trainer-url (LOCKSTEP_TRAINER_URL) the TrainerGroup's ranks
take every step and keep the checkpoints; without it the trainer runs in this process. Either way a
restarted pod resumes from the latest checkpoint, if there is one. In the pod the loop patches its
progress into the ConfigMap the operator folds into RLJob status (lockstep.progress).
docs/trainer.md explains the split.

Who calls it: the driver pod (operator/lockstep_operator/resources/commands.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from lockstep.api import ManifestError, load_manifest
from lockstep.cli.commands import HELP
from lockstep.cli.run import EXIT_CODES, execute
from lockstep.config.driver import needs_engines
from lockstep.driver.settings import Resume, RunOptions
from lockstep.observability.logs import configure_logging
from lockstep.progress import ConfigMapReporter, reporter_from_env, start_failure


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "driver",
        help=HELP["driver"],
        description=__doc__,
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", type=Path, required=True, help="rendered RLJob (job.yaml)")
    p.add_argument(
        "--run-dir", type=Path, default=Path(os.environ.get("LOCKSTEP_RUN_DIR", "/var/lib/lockstep/run"))
    )
    p.add_argument(
        "--engine-url",
        action="append",
        default=[],
        help="engine or router URL (default: $LOCKSTEP_ROUTER_URL)",
    )
    p.add_argument("--steps", type=int, default=None, help="override spec.schedule.steps")
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get("LOCKSTEP_METRICS_PORT", "0")))
    p.add_argument("--engine-timeout", type=float, default=300.0, help="seconds to wait for the engines")
    p.add_argument(
        "--trainer-url",
        default=os.environ.get("LOCKSTEP_TRAINER_URL") or None,
        help="rank 0 of the trainer group (default: $LOCKSTEP_TRAINER_URL; unset: train in this process)",
    )
    p.add_argument(
        "--trainer-timeout", type=float, default=900.0, help="seconds to wait for the trainer group"
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:

    configure_logging()
    try:
        job = load_manifest(args.config)
    except (ManifestError, FileNotFoundError) as e:
        print(f"error: {args.config}: {e}", file=sys.stderr)
        reporter_from_env().report(start_failure(e, "driver"))  # the job fails with it, no restart loop
        return 2
    urls = list(args.engine_url) or (
        [os.environ["LOCKSTEP_ROUTER_URL"]] if os.environ.get("LOCKSTEP_ROUTER_URL") else []
    )
    if not urls and needs_engines(job):  # an SFT job has no engines
        print("error: no engine URL: pass --engine-url or set LOCKSTEP_ROUTER_URL", file=sys.stderr)
        return 2
    options = RunOptions(
        steps=args.steps,
        resume=Resume.IF_ANY,  # a restarted driver pod resumes from the latest checkpoint, if there is one
        engine_urls=tuple(urls),
        metrics_port=args.metrics_port,
        engine_timeout_s=args.engine_timeout,
        trainer_url=args.trainer_url,
        trainer_timeout_s=args.trainer_timeout,
        preempted_exit=3,  # after SIGTERM's checkpoint: a pod that was not deleted restarts and resumes
    )
    _log_progress_channel()
    return execute(job, args.run_dir, options, install_signal=True)


def _log_progress_channel() -> None:
    """Say where progress goes (build_components picks the same reporter from the environment)."""
    reporter = reporter_from_env()
    where = (
        f"ConfigMap {reporter.namespace}/{reporter.name} at {reporter.api_url}"
        if isinstance(reporter, ConfigMapReporter)
        else "nowhere (not in a driver pod)"
    )
    logging.getLogger("lockstep.driver").info("progress reports go to %s", where)
