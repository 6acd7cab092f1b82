"""The `lockstep` command: one subcommand per module of this package.

Why it exists: the same binary runs a whole job on one machine (`lockstep run`), checks manifests
offline (`lockstep validate`), serves the reference engine, runs trainer ranks, the driver, the
session server, and the disk-delta tools. Each subcommand lives in its own module here and exposes
`register(subparsers)`, which adds its parser and sets `func(args) -> int`. No module imports torch at
import time, so `lockstep validate` stays fast and light.

Who calls it: users, the pods the operator creates, and tests.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lockstep",
        description="RL post-training with the rollout engine and the trainer on the same policy.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
