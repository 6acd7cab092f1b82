"""A LoRA job's driver side: its rollouts sample the adapter version the trainer last published.

Why it exists: the trainer loads each adapter version on the engines under its own name
(lockstep.weights.adapter); the rollout client must then name that version in every request
(lockstep.rollout.adapter.AdapterClient). `AdapterVersions` wraps the Trainer so that the version a
first update or an update reports becomes the one the rollout samples with, in both loops and with a
local or remote trainer, without either loop knowing about adapters.

Who calls it: lockstep.driver.components and lockstep.driver.rollout (RunConfig.adapter: a job with spec.model.lora).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from lockstep.rollout.adapter import AdapterClient

R = TypeVar("R")

if TYPE_CHECKING:
    from lockstep.rollout.generate import Rollout
    from lockstep.serving.client import GenerateBackend
    from lockstep.trainer.protocol import Trainer


@dataclass(slots=True)
class AdapterVersions:
    """A Trainer whose updates also move the rollout's adapter version (other calls pass through)."""

    inner: Trainer
    """The local or remote trainer."""
    client: AdapterClient
    """The rollout's adapter client."""

    def first_update(self, version: int) -> dict[str, float]:
        metrics = self.inner.first_update(version)
        self.client.version = version
        return metrics

    def update_weights(self, version: int) -> dict[str, float]:
        metrics = self.inner.update_weights(version)
        self.client.version = version
        return metrics

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def sampling_client(adapter: str | None, client: GenerateBackend) -> GenerateBackend:
    """The rollout's engine client: for a LoRA job (`adapter`, its name on the engines) wrapped to
    sample its adapter, else `client`."""
    if adapter is None:
        return client
    return AdapterClient(client, adapter)


def adapter_reporter(adapter: str | None, reporter: R) -> R:
    """For a LoRA job (`adapter`, its name on the engines): the progress reporter whose per-engine
    version probe reads the job's adapter versions (GET /v1/models) instead of the engines'
    weight_version, which is the base's and which a LoRA job never moves (it would read as behind and
    the operator would gate every engine out of the router). An engine that joined since the last
    update holds none of the job's versions and stays out of the router until the trainer's next
    update has loaded one there. Other jobs: unchanged."""
    probe = getattr(reporter, "probe", None)
    if adapter is not None and probe is not None:
        reporter.probe = replace(probe, adapter=adapter)  # type: ignore[attr-defined]
    return reporter


def versioned_trainer(trainer: Trainer, rollout: Rollout) -> Trainer:
    """For a rollout that samples an adapter: the trainer whose updates select its version. Others:
    `trainer` unchanged."""
    client = rollout.ctx.client
    if not isinstance(client, AdapterClient):
        return trainer
    return AdapterVersions(trainer, client)
