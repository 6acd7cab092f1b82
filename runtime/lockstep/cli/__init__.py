"""The `lockstep` command: one subcommand per module of this package.

Why it exists: the same binary runs a whole job on one machine (`lockstep run`), checks manifests
offline (`lockstep validate`), serves the reference engine, runs trainer ranks, the driver, the
session server, and the disk-delta tools. Each subcommand lives in its own module here and exposes
`register(subparsers)`, which adds its parser and sets `func(args) -> int` (a dash in a subcommand is
an underscore in its module name: `pull-model` is pull_model.py). Only the chosen
subcommand's module is imported (commands.py lists them), so `lockstep validate` never loads torch.

Who calls it: users, the pods the operator creates, and tests.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Iterable, Sequence

from lockstep.cli.commands import HELP


def build_parser(commands: Iterable[str] = tuple(HELP)) -> argparse.ArgumentParser:
    """The parser, with the full arguments of `commands` (their modules imported) and a help line for
    every other subcommand."""
    parser = argparse.ArgumentParser(
        prog="lockstep",
        description="RL post-training with the rollout engine and the trainer on the same policy.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    full = set(commands)
    for name, help_line in HELP.items():
        if name in full:
            importlib.import_module(f"{__name__}.{name.replace('-', '_')}").register(sub)
        else:
            sub.add_parser(name, help=help_line)
    return parser


def exit_on_sigterm_as_pid1() -> None:
    """In a container `lockstep` is PID 1 (the engine and driver pods), and the kernel drops every
    signal PID 1 has no handler for. So a SIGTERM during start-up (seconds of imports and checkpoint
    loading, before a command installs its graceful handler) was lost: found on the real node, an
    engine deleted while it loaded kept running for its whole grace period (600 s). Until a command
    installs its own handler, SIGTERM ends PID 1 as it ends any other process (exit 143). Elsewhere
    nothing changes."""
    if os.getpid() == 1 and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, _frame: os._exit(128 + signum))


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm_as_pid1()
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)  # the top level has no options
    parser = build_parser([chosen] if chosen in HELP else [])
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
