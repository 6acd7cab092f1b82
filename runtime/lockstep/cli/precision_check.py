"""`lockstep precision-check MANIFEST`: check a job's low-precision recipe before training with it.

Why it exists: §6 says how a recipe earns trust: shared quantizer, exception alignment,
per-tensor weight-update check, logprobs on the same sampled tokens, online importance ratio, in
this order. This command runs the five steps on this machine with the job's model and recipe
(lockstep.cli.precision) and prints one line per step; `--json` prints them as JSON.

Exit codes: 0 every step passed, 1 a step failed, 2 bad manifest or no low-precision recipe.
Who calls it: users before `lockstep run` or `kubectl apply` of a fp8/mxfp8/nvfp4 job; tests.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lockstep.api import ManifestError, load_manifest
from lockstep.cli.commands import HELP
from lockstep.cli.precision import precision_check


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "precision-check",
        help=HELP["precision-check"],
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "manifest", type=Path, help="RLJob YAML file with rollout (or trainer) precision fp8|mxfp8|nvfp4"
    )
    p.add_argument("--samples", type=int, default=8, help="completions sampled for the logprob steps")
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="where builtin:<name> checkpoints are written"
    )
    p.add_argument("--json", action="store_true", help="print the steps as JSON")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        job = load_manifest(args.manifest)
        checks = precision_check(job, cache_dir=args.cache_dir, samples=args.samples)
    except (ManifestError, ValueError, FileNotFoundError) as e:
        print(f"lockstep precision-check: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            print(f"{c.step}. {c.name:<36} {'PASS' if c.passed else 'FAIL'}  {c.detail}")
    return 0 if all(c.passed for c in checks) else 1
