"""The operator run in-process for e2e tests (kopf.testing.KopfRunner, standalone, all namespaces).

One class for the kwok tests and the real-pod tests, so both exercise the same start and restart."""

from __future__ import annotations

from typing import Any


class Operator:
    """The operator running in-process; `restart()` stops it and starts a fresh runner."""

    def __init__(self) -> None:
        self.runner: Any = None

    def start(self) -> None:
        from kopf.testing import KopfRunner

        args = ["run", "--standalone", "--all-namespaces", "-m", "lockstep_operator.handlers"]
        self.runner = KopfRunner(args, timeout=60)
        self.runner.__enter__()

    def stop(self) -> None:
        if self.runner is not None:
            self.runner.__exit__(None, None, None)
            self.runner = None

    def restart(self) -> None:
        self.stop()
        self.start()
