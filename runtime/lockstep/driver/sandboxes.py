"""The driver's sandboxes: a sandbox job's SandboxSetup turned into a provider (local or the cluster's).

Why it exists: the terminal agent claims one sandbox per episode through the SandboxProvider protocol;
which provider depends on where the driver runs. In a driver pod the operator names the job's warm
pool (LOCKSTEP_SANDBOX_WARMPOOL, with the namespace) and episodes claim sandbox pods from it
(lockstep.sandbox.cluster); under `lockstep run` a local sandbox confines each episode to a fresh
directory under the run dir (lockstep.sandbox.local). Both read one typed config, SandboxSetup,
built from the manifest by lockstep.config.driver (which also gives a sandbox job its default agent
and reward functions).

Who calls it: lockstep.driver.components.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Final

from lockstep.sandbox.cluster import ClusterSandboxProvider
from lockstep.sandbox.local import LocalSandboxProvider

if TYPE_CHECKING:
    from lockstep.config.driver import SandboxSetup
    from lockstep.sandbox.base import SandboxProvider

WARMPOOL_ENV: Final = "LOCKSTEP_SANDBOX_WARMPOOL"
"""Set by the operator in a driver pod: the job's SandboxWarmPool; episodes claim from it."""
NAMESPACE_ENV: Final = "POD_NAMESPACE"
"""Every job pod's namespace (downward API)."""


def build_sandboxes(setup: SandboxSetup | None, run_dir: Path) -> SandboxProvider | None:
    """The job's sandbox provider, or None without sandboxes: claims on the job's warm pool in a
    driver pod (LOCKSTEP_SANDBOX_WARMPOOL), else local sandboxes under RUN_DIR/sandboxes."""
    if setup is None:
        return None
    pool = os.environ.get(WARMPOOL_ENV)
    if pool:  # a driver pod: the operator made the job's warm pool
        return ClusterSandboxProvider(
            config=setup.config,
            namespace=os.environ.get(NAMESPACE_ENV, "default"),
            warm_pool=pool,
            job=setup.job_name,
            max_sandboxes=setup.concurrency,
        )
    return LocalSandboxProvider(setup.config, run_dir / "sandboxes", max_sandboxes=setup.concurrency)
