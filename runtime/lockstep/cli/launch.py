"""`lockstep launch TORCHRUN-ARGS`: torchrun whose rendezvous store binds the pod IP (lockstep.trainer.rendezvous).

Why it exists: the trainer rank pods start their ranks with torchrun, whose static rendezvous store
listens on every interface; `lockstep launch` takes the same arguments and binds it to one address.
Every argument goes to torchrun unchanged (`lockstep launch --help` is torchrun's help).

Who calls it: the trainer rank pods the operator creates, tests.
"""

from __future__ import annotations

import argparse

from lockstep.cli.commands import HELP
from lockstep.trainer.rendezvous import launch


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # prefix_chars "+": no option of ours, so every `-x` / `--x` after `launch` is torchrun's.
    parser = subparsers.add_parser("launch", help=HELP["launch"], prefix_chars="+", add_help=False)
    parser.add_argument("torchrun_args", nargs=argparse.REMAINDER, help="torchrun's arguments")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return launch(args.torchrun_args)
