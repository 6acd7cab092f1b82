"""A pytest plugin that saves the suite's per-test durations under bench/results each time it runs.

Why it exists: `make check` must stay within its time budget and `make test` within CI's; which tests
cost what is only known when the suite is measured, so every measured run leaves its record:
`--durations-file PATH` writes the wall time, the slowest tests and the slowest files as markdown
(`{date}` in PATH becomes today's date, UTC). The Makefile passes it for `make check` and `make test`.

Use: `python -m pytest -p bench.pytest_durations --durations-file bench/results/pytest_durations_{date}_cpu.md`
"""

from __future__ import annotations

import datetime
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

TOP_TESTS = 60
TOP_FILES = 30


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--durations-file",
        default=None,
        help="write per-test durations as markdown to this path ({date}: today, UTC)",
    )


class _Recorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.start = time.monotonic()
        self.seconds: dict[str, float] = defaultdict(float)
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        wall = time.monotonic() - self.start
        tests = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        files: dict[str, float] = defaultdict(float)
        for nodeid, s in tests:
            files[nodeid.split("::")[0]] += s
        counts: dict[str, int] = defaultdict(int)
        for outcome in self.outcomes.values():
            counts[outcome] += 1
        lines = [
            f"# pytest durations, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
            "",
            f"`{' '.join(['pytest', *sys.argv[1:]])}`",
            "",
            f"- wall time: {wall:.1f} s; sum of test times (setup + call + teardown): {sum(self.seconds.values()):.1f} s",
            f"- tests: {len(tests)} ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))}); exit status {exitstatus}",
            "",
            f"## Slowest {min(TOP_TESTS, len(tests))} tests",
            "",
            "| seconds | test |",
            "| --- | --- |",
            *[f"| {s:.2f} | `{nodeid}` |" for nodeid, s in tests[:TOP_TESTS]],
            "",
            f"## Slowest {min(TOP_FILES, len(files))} files",
            "",
            "| seconds | file |",
            "| --- | --- |",
            *[f"| {s:.1f} | `{f}` |" for f, s in sorted(files.items(), key=lambda kv: -kv[1])[:TOP_FILES]],
            "",
        ]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(lines))


def pytest_configure(config: pytest.Config) -> None:
    target = config.getoption("--durations-file")
    if target:
        date = datetime.datetime.now(datetime.UTC).date().isoformat()
        config.pluginmanager.register(_Recorder(Path(target.replace("{date}", date))), "lockstep-durations")
