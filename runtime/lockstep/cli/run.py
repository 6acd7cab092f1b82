"""`lockstep run MANIFEST`: run a whole RL job on this machine (the README's main-job command).

Why it exists: the manifest a user applies to a cluster also runs whole on one machine: reference
engine(s) in-process on 127.0.0.1, the FSDP2 trainer as one rank, the sync (or fully-async) loop, a
progress bar, metrics.jsonl + metrics.png in the run dir and an optional Prometheus endpoint.

Exit codes: 0 done (or stopped by Ctrl-C with a checkpoint), 2 bad manifest or settings, 3 engine
(or trainer group) unreachable, 4 non-finite loss (last good checkpoint intact), 5 pre-flight weight check failed,
6 rollout failed (every trajectory failing, fully-async), 130 abandoned by a second Ctrl-C.

Who calls it: users (`make run`), tests.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from pathlib import Path
from typing import Any

from lockstep.api import ManifestError, RLJob, load_manifest
from lockstep.cli.commands import HELP
from lockstep.driver import Preemption, run
from lockstep.driver.loop import install_sigint
from lockstep.driver.remote import TrainerUnreachable
from lockstep.driver.settings import Resume, RunOptions
from lockstep.observability.logs import configure_logging
from lockstep.observability.metrics import read_jsonl
from lockstep.rollout.async_worker import RolloutFailed
from lockstep.serving.client import EngineUnreachable
from lockstep.trainer.protocol import NonFiniteLoss, PreflightFailed
from lockstep.weights.preflight import PREFLIGHT_FILE, PreflightResult

log = logging.getLogger("lockstep.run")

EXIT_CODES = """exit codes:
  0    done, or stopped by Ctrl-C after the current step with a checkpoint (continue with --resume)
  2    bad manifest or unsupported settings (the message names the field)
  3    a rollout engine (or the trainer group, `lockstep driver`) is unreachable
  4    non-finite loss: stopped, the last good checkpoint is intact
  5    pre-flight weight check (spec.weightSync.checkWeightUpdateEqual) failed; no step was trained
  6    rollout failed: trajectories kept failing (the last error is named; fully-async)
  130  abandoned by a second Ctrl-C (resume from the last saved checkpoint)"""
"""The exit codes `lockstep run` and `lockstep driver` return, shown in --help."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help=HELP["run"],
        description=__doc__,
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("manifest", type=Path, help="RLJob YAML file")
    p.add_argument("--run-dir", type=Path, default=None, help="run directory (default: runs/<metadata.name>)")
    p.add_argument("--steps", type=int, default=None, help="override spec.schedule.steps")
    p.add_argument("--resume", action="store_true", help="continue from the run dir's latest checkpoint")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port on 127.0.0.1 (0 = off)")
    p.add_argument(
        "--engine-url", action="append", default=[], help="use this running engine instead of starting one"
    )
    p.add_argument(
        "--engine-timeout", type=float, default=60.0, help="seconds to wait for engines to be ready"
    )
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="where builtin:<name> checkpoints are written"
    )
    p.set_defaults(func=main)


def execute(job: RLJob, run_dir: Path, options: RunOptions, install_signal: bool) -> int:
    """Run `job` and map the known failures to exit codes with one clear line each. SIGTERM stops
    rollout at once and checkpoints (lockstep.driver.preemption; exit options.preempted_exit)."""
    stop = threading.Event()
    preemption = Preemption()
    if install_signal:
        install_sigint(stop)
        preemption.install(stop)
    try:
        state = run(job, run_dir, options, stop=stop, preemption=preemption)
    except (EngineUnreachable, TrainerUnreachable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except NonFiniteLoss as e:
        print(
            f"error: {e}; stopped, the last good checkpoint in {run_dir / 'checkpoints'} is intact",
            file=sys.stderr,
        )
        return 4
    except PreflightFailed as e:
        print(f"error: pre-flight failed, no step was trained: {e}", file=sys.stderr)
        return 5
    except RolloutFailed as e:
        print(f"error: rollout failed: {e}", file=sys.stderr)
        return 6
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"abandoned; resume from the last checkpoint with --resume (run dir {run_dir})", file=sys.stderr
        )
        return 130
    took = preemption.seconds_since()
    if took is not None:
        how = f"stopped by SIGTERM, checkpoint in {took:.1f} s; continue with --resume"
    else:
        how = "stopped by Ctrl-C; continue with --resume" if stop.is_set() else "done"
    print(
        f"{how}: step {state.step}{_reward_summary(run_dir)}{_preflight_summary(run_dir)}, "
        f"run dir {run_dir} (metrics.jsonl, metrics.png)"
    )
    return options.preempted_exit if took is not None else 0


def _reward_summary(run_dir: Path) -> str:
    """ ", reward 0.91 (last 10 steps), eval 0.98" from the run's metrics file ("" when it has none)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    # OPD with taskReward zero trains on reward 0: its task reward is the one to show.
    key = "task_reward_mean" if any("task_reward_mean" in r for r in rows) else "reward_mean"
    train = [r[key] for r in rows if r["kind"] == "train" and r.get(key) is not None][-10:]
    evals = [r["reward_mean"] for r in rows if r["kind"] == "eval" and r.get("reward_mean") is not None]
    out = f", reward {sum(train) / len(train):.2f} (last {len(train)} steps)" if train else ""
    losses = [r["loss"] for r in rows if r["kind"] == "train" and key not in r and "loss" in r]
    if losses and not train:  # an SFT job: its loss, first step and last
        out = f", loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    return out + (f", eval {evals[-1]:.2f}" if evals else "")


def _preflight_summary(run_dir: Path) -> str:
    """ ", pre-flight passed (N tensors equal ...)" when this run's pre-flight wrote its result."""
    path = run_dir / PREFLIGHT_FILE
    if not path.is_file():
        return ""
    result = PreflightResult.model_validate_json(path.read_text())
    return f", pre-flight {'passed' if result.passed else 'FAILED'} ({result.message})"


def main(args: argparse.Namespace) -> int:
    configure_logging()
    try:
        job = load_manifest(args.manifest)
    except ManifestError as e:
        print(f"error: {args.manifest} is not a valid RLJob:\n{e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir = args.run_dir or Path("runs") / job.metadata.name
    options = RunOptions(
        steps=args.steps,
        resume=Resume.REQUIRED if args.resume else Resume.NEVER,
        engine_urls=tuple(args.engine_url),
        metrics_port=args.metrics_port,
        cache_dir=args.cache_dir,
        engine_timeout_s=args.engine_timeout,
    )
    return execute(job, run_dir, options, install_signal=True)
