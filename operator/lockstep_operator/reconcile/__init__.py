"""Reconcile functions, one module per kind: ordered idempotent steps from observed state to desired.

Each `reconcile_*` fetches its object, returns early when it is being deleted (owner references let
the garbage collector remove children), server-side applies the children, reads what it observes,
computes the status with the pure functions of `status` (composed of lockstep_operator.policy), and
writes it once, only if it changed. `dispatch` maps a work-queue key to its kind's reconcile, gives the
pass a `Recorder` for its Events and posts them after the pass; a pass that fails sets the object's
ReconcileError condition with the API's message and a Warning Event (errors.record_failure) before the
work queue retries it with backoff.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable

from lockstep_operator.k8s.client import ApiError, KubeClient
from lockstep_operator.k8s.events import EventSink, Recorder
from lockstep_operator.reconcile.errors import record_failure
from lockstep_operator.reconcile.rljob import reconcile_job
from lockstep_operator.reconcile.rolloutpool import reconcile_pool
from lockstep_operator.reconcile.trainergroup import reconcile_trainer
from lockstep_operator.reconcile.weightchannel import reconcile_channel
from lockstep_operator.settings import OperatorSettings

Key = tuple[str, str, str]
"""(kind, namespace, name) of an object to reconcile."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def dispatch(
    kube: KubeClient, settings: OperatorSettings, sink: EventSink | None = None
) -> Callable[[Key], Awaitable[None]]:
    """The function the work queue runs: a key to its kind's reconcile, at the current time; its Events
    posted to `sink` after the pass (None: not posted)."""

    async def run(key: Key) -> None:
        kind, namespace, name = key
        recorder, now = Recorder(sink), _now()
        try:
            await _one(kind, namespace, name, now, recorder)
        except ApiError as err:
            if err.status != 404:  # 404: the object went away during the pass
                await record_failure(kube, kind, namespace, name, err, recorder, now=now)
            raise
        except Exception as err:
            await record_failure(kube, kind, namespace, name, err, recorder, now=now)
            raise
        finally:
            await recorder.flush()

    async def _one(kind: str, namespace: str, name: str, now: dt.datetime, recorder: Recorder) -> None:
        if kind == "RLJob":
            await reconcile_job(kube, namespace, name, settings=settings, now=now, recorder=recorder)
        elif kind == "RolloutPool":
            await reconcile_pool(kube, namespace, name, settings=settings, now=now, recorder=recorder)
        elif kind == "TrainerGroup":
            await reconcile_trainer(kube, namespace, name, settings=settings, now=now, recorder=recorder)
        elif kind == "WeightChannel":
            await reconcile_channel(kube, namespace, name, now=now, recorder=recorder)

    return run
