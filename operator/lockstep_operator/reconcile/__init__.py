"""Reconcile functions, one module per kind: ordered idempotent steps from observed state to desired.

Each `reconcile_*` fetches its object, returns early when it is being deleted (owner references let
the garbage collector remove children), server-side applies the children, reads what it observes,
computes the status with the pure functions of `status` (composed of lockstep_operator.policy), and
writes it once, only if it changed. `dispatch` maps a work-queue key to its kind's reconcile.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable

from lockstep_operator.k8s.client import KubeClient
from lockstep_operator.reconcile.rljob import reconcile_job
from lockstep_operator.reconcile.rolloutpool import reconcile_pool
from lockstep_operator.reconcile.trainergroup import reconcile_trainer
from lockstep_operator.reconcile.weightchannel import reconcile_channel
from lockstep_operator.settings import OperatorSettings

Key = tuple[str, str, str]
"""(kind, namespace, name) of an object to reconcile."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def dispatch(kube: KubeClient, settings: OperatorSettings) -> Callable[[Key], Awaitable[None]]:
    """The function the work queue runs: a key to its kind's reconcile, at the current time."""

    async def run(key: Key) -> None:
        kind, namespace, name = key
        if kind == "RLJob":
            await reconcile_job(kube, namespace, name, settings=settings, now=_now())
        elif kind == "RolloutPool":
            await reconcile_pool(kube, namespace, name, settings=settings, now=_now())
        elif kind == "TrainerGroup":
            await reconcile_trainer(kube, namespace, name, settings=settings, now=_now())
        elif kind == "WeightChannel":
            await reconcile_channel(kube, namespace, name, now=_now())

    return run
