"""A torchrun worker's end (lockstep.cli.trainer.end_worker) loses none of Python's own exit steps.

It skips the interpreter's C++ teardown (where torch sometimes aborts a rank that shut down cleanly),
so what that teardown would have done first must still happen: a non-daemon thread (a checkpoint
writer) runs to its end, atexit handlers run, buffered output reaches the pipe, and the exit code is
the command's. Outside torchrun the code is only returned.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROGRAM = """
import atexit, concurrent.futures, sys, threading, time
from pathlib import Path
from lockstep.cli.trainer import end_worker
out = Path(sys.argv[1])
def writer():
    time.sleep(0.5)
    (out / "thread").write_text("done")
threading.Thread(target=writer).start()
pool = concurrent.futures.ThreadPoolExecutor(2)  # never shut down: its idle workers must not hold the exit
pool.submit(time.sleep, 0).result()
atexit.register(lambda: (out / "atexit").write_text("done"))
print("buffered line", end="")
code = end_worker(7)
print(f" returned {code}", end="")
"""


def _run(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # a hang is the failure this guards against: the timeout ends it
        [sys.executable, "-c", PROGRAM, str(tmp_path)], capture_output=True, text=True, env=env, timeout=60
    )


def test_under_torchrun_the_worker_ends_with_its_code_after_pythons_own_exit_steps(tmp_path: Path) -> None:
    import os

    proc = _run(tmp_path, {**os.environ, "TORCHELASTIC_RUN_ID": "test"})
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout == "buffered line"  # flushed; nothing after end_worker ran
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "done"


def test_outside_torchrun_the_code_is_returned(tmp_path: Path) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    proc = _run(tmp_path, env)
    assert proc.returncode == 0 and proc.stdout == "buffered line returned 7", proc.stderr
