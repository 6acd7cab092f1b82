"""`lockstep pull-model REF --dest DIR`: fetch a Hugging Face model into a directory, once.

Why it exists: in a cluster every pod of a job must read the same files, and only one step should
talk to the hub. The operator's init step runs exactly this command into the job's model volume;
the engine, trainer and driver pods then see a plain HF-layout directory. By hand it prepares an
offline machine: pull where the hub is reachable, copy DIR, point spec.model.checkpoint at it.

Contract: REF is `org/name` or `org/name@revision` (`--dataset`: a dataset repo, its data files and
card, for spec.data.prompts: DIR[:config][:split]); the token comes from HF_TOKEN (never printed),
the endpoint from HF_ENDPOINT, HF_HUB_OFFLINE=1 copies from the local cache only. Exit 0 with one
line naming DIR on success; exit 2 with a message naming the repo otherwise.

Who calls it: the operator's model-volume init container, users.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from lockstep.cli.commands import HELP
from lockstep.models.checkpoint import CheckpointError, parse_hub_ref, snapshot
from lockstep.models.hub_data import DATA_PATTERNS


def register(sub: Any) -> None:
    p = sub.add_parser("pull-model", help=HELP["pull-model"], description=__doc__.split("\n\n")[1])
    p.add_argument("ref", metavar="REF", help="Hugging Face repo id, org/name or org/name@revision")
    p.add_argument("--dest", type=Path, required=True, help="directory the model's files are written into")
    p.add_argument(
        "--dataset", action="store_true", help="REF is a dataset repo (prompts for spec.data.prompts)"
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    ref = parse_hub_ref(args.ref)
    if ref is None:
        print(
            f"error: {args.ref!r} is not a Hugging Face repo id; give org/name or org/name@revision",
            file=sys.stderr,
        )
        return 2
    try:
        if args.dataset:
            path = snapshot(ref, dest=args.dest, repo_type="dataset", allow_patterns=DATA_PATTERNS)
        else:
            path = snapshot(ref, dest=args.dest)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.dataset and not (path / "config.json").is_file():
        print(
            f"error: model {ref}: {path} has no config.json; is {ref.repo_id} a model repo?", file=sys.stderr
        )
        return 2
    print(f"pulled {ref} into {path}")
    return 0
