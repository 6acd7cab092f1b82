"""CPU thread budget of a whole job run in one process (`lockstep run` with its engines in-process).

Why it exists: the trainer and each in-process CPU engine call torch from their own thread, and each
such thread gets its own intra-op team of torch.get_num_threads() threads (default: one per core).
With the engine's and the client's event loops also needing a core, the teams oversubscribe the
machine: on 2 cores the example job ran 1.4 RL steps/s with torch's default and 1.9 steps/s with one
intra-op thread, same results (bench/results/cpu_threads_2026-12-03_cpu.md). So the cores are shared
out between the CPU workers, unless the user chose (OMP_NUM_THREADS) or nothing computes on the CPU.

Who calls it: lockstep.driver.components.build_components, lockstep.driver.sft.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

THREADS_ENV = "OMP_NUM_THREADS"
"""A user's explicit thread count; when set, it wins."""


def intra_op_threads(cores: int, cpu_workers: int, env: Mapping[str, str]) -> int | None:
    """Intra-op threads per torch-calling thread, or None to keep torch's default (pure).

    cores: the cores this process may use; cpu_workers: threads computing on the CPU in this process
    (the in-process trainer and each in-process CPU engine). None when the user set OMP_NUM_THREADS or
    at most one worker computes on the CPU (it has the cores to itself).
    """
    if env.get(THREADS_ENV, "").strip() or cpu_workers <= 1:
        return None
    return max(1, cores // cpu_workers)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: a container's cpuset, taskset)."""
    return len(os.sched_getaffinity(0))


def share_cpu(cpu_workers: int, cores: int | None = None) -> Callable[[], None]:
    """Apply intra_op_threads to torch; returns the undo (the previous count), for the run's closers.

    cores: the machine's share to divide (default: usable_cores())."""
    import torch

    cores = usable_cores() if cores is None else cores
    threads = intra_op_threads(cores, cpu_workers, os.environ)
    if threads is None:
        return lambda: None
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    log.info(
        "torch intra-op threads: %d (%d cores shared by %d CPU workers in this process; set %s to choose)",
        threads,
        cores,
        cpu_workers,
        THREADS_ENV,
    )
    return lambda: torch.set_num_threads(previous)
