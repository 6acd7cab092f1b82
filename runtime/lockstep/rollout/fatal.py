"""StopsTheRun: the mark of an error that ends the run instead of failing one sample.

Why it exists: both loops turn an exception of a generate, agent or reward function into a FAILED
sample (the run goes on, the group is dropped). Some errors are not the sample's fault and must stop
the run with their own message: a sample whose label routes to no teacher (the manifest cannot
distill it), or a teacher that scores other tokens than it was sent. Such an error class inherits
StopsTheRun (and the builtin type that tells `lockstep run` its exit code, e.g. ValueError for a
setting to fix); Rollout.run_sample and the fully-async worker re-raise it like an unreachable engine.

Who uses it: lockstep.rollout.generate, lockstep.rollout.async_worker, lockstep.rollout.opd.
"""

from __future__ import annotations


class StopsTheRun(Exception):
    """Mixin of errors that stop the run (see the module doc)."""
