"""`lockstep validate MANIFEST...`: check manifests offline with the same rules as the cluster.

Why it exists: a bad combination (fully-async with colocate, NVFP4 serving on BF16 training, ...)
should fail before anything is applied or any GPU is spent. This runs the pydantic models and the
cross-field rules of lockstep.api (the same expressions the CRDs carry as CEL), without a cluster.

Output: nothing and exit 0 when every file is valid (with --show-defaults, the objects as YAML with
every default filled in); otherwise one line per problem, `FILE: path: value: what to do`, and exit 1
(exit 2 for a file that cannot be read).
Who calls it: users, CI, tests.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from lockstep.api import ManifestError, load_objects
from lockstep.cli.commands import HELP


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "validate",
        help=HELP["validate"],
        description="Check Lockstep manifests offline; one line per problem: FILE: path: value: what to do.",
    )
    parser.add_argument(
        "manifests", nargs="+", metavar="MANIFEST", help="YAML files to check (`-` reads standard input)"
    )
    parser.add_argument(
        "--show-defaults",
        action="store_true",
        help="print each valid object as YAML with every default filled in (what the cluster stores)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    code = 0
    for path in args.manifests:
        try:
            # a text source must look like YAML text to load_objects; give stdin a trailing newline
            objects = load_objects(sys.stdin.read() + "\n" if path == "-" else Path(path))
        except OSError as exc:
            print(f"{path}: cannot read: {exc.strerror or exc}", file=sys.stderr)
            code = 2
        except ManifestError as err:
            for problem in err.problems:
                print(f"{path}: {problem}")
            code = max(code, 1)
        else:
            if args.show_defaults:
                wire = [o.model_dump(mode="json", by_alias=True, exclude_none=True) for o in objects]
                order = ("apiVersion", "kind", "metadata", "spec", "status")
                docs = [{k: d[k] for k in order if k in d} for d in wire]
                print(yaml.safe_dump_all(docs, sort_keys=False), end="")
    return code
