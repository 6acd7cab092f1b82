"""Sampling with a LoRA job's adapter: every /generate names the adapter version being trained.

Why it exists: a LoRA job's engines serve the shared base plus adapters by name (SGLang's
--enable-lora); a request that names no adapter samples the base, another job's name samples that
job's policy. `AdapterClient` wraps the engine client so that every request of this job (rollouts,
evaluation, plugins' generate functions) carries `lora_path` = `<adapter>-v<version>` of the version
the trainer last published (lockstep.serving.lora), whatever the caller passes. The version of every
sampled token is that adapter's version: a loaded name never changes weights, so it is exact, and it
is this job's own version, not the engine's base weight_version (which other jobs on a shared engine
never move).

Who calls it: lockstep.driver (wraps the rollout client of a LoRA job; sets `version` after each
update).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lockstep.serving.client import GenerateBackend, GenerateResult
from lockstep.serving.lora import served_name
from lockstep.serving.payloads import SamplingParams


@dataclass(slots=True)
class AdapterClient:
    """A GenerateBackend sampling with this job's adapter (see the module doc)."""

    inner: GenerateBackend
    """The engine client (PoolClient, RoutedExpertsClient, ...)."""
    adapter: str
    """The job's adapter name (spec.model.lora.adapterName, else the job's name)."""
    version: int | None = None
    """The version the trainer last loaded on every engine; None before the first update."""

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        return_logprob: bool = True,
        logprob_start_len: int = -1,
        return_routed_experts: bool = False,
        rid: str | None = None,
        lora_path: str | None = None,
    ) -> GenerateResult:
        """The wrapped generate with lora_path set to the current adapter version; the result's
        token versions are that version. Before the first update (the evaluation of the starting
        policy) nothing is loaded yet and the base samples: the policy a fresh adapter starts as
        (peft's lora_B is zero)."""
        del lora_path  # this job samples its own adapter, never another
        version = self.version
        result = await self.inner.generate(
            input_ids,
            sampling_params,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            return_routed_experts=return_routed_experts,
            rid=rid,
            lora_path=None if version is None else served_name(self.adapter, version),
        )
        if version is None:
            return result
        result.token_versions = [version] * len(result.output_ids)
        result.weight_version = version
        return result

    @property
    def clients(self) -> None:
        """Not the wrapped pool's replica clients: the TITO session server would reach them directly
        (session affinity, lockstep.rollout.session.local.turn_engine) and its turns would sample the
        base. It takes this client as one backend instead, so every turn carries the adapter."""
        return None

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
