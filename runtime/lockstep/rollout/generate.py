"""Turning prompts into scored groups: the default single-turn generate and the group runner.

Why it exists: the sync driver and the fully-async worker both need "take a Sample with its prompt,
produce a scored trajectory". `Rollout.run_sample` is that function (it matches the async worker's
GenerateSample contract): it runs the agent or generate function, decodes the response, scores it with
the reward function, and marks the sample FAILED if user code raised (never trained on, never lost
silently: the error is logged with the sample index). `Rollout.generate_group` renders a task item
with the chat format and runs n samples of it concurrently.

Token-exactness (TITO): the response IDs, their logprobs and their weight versions are exactly what
the engine returned; nothing is re-tokenised.

R3 (MoE routing replay, §4.1): `RoutedExpertsClient` wraps the engine client so that every
/generate asks for return_routed_experts, whatever the generate or agent function passes (capture
options are the runtime's business, as in the TITO session server). The driver wraps the client in
it when spec.algorithm.r3 is on; `single_turn` stores the payload in Sample.routed_experts. An engine
that answers a finished request without routing data (SGLang started without
--enable-return-routed-experts) is an error, never a silent run without replay.

Who calls it: lockstep.driver (loop and components), lockstep.driver.fully_async.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lockstep.rollout.fatal import StopsTheRun
from lockstep.rollout.plugins import AgentContext, Plugins, RolloutContext, call_reward
from lockstep.serving.client import GenerateBackend, GenerateResult
from lockstep.serving.payloads import SamplingParams
from lockstep.types import Group, Sample, SampleStatus

log = logging.getLogger(__name__)

_FINISH_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


def sample_seed(run_seed: int, group_index: int, index: int) -> int:
    """A per-sample sampling seed, fixed by (run seed, group, sample): reruns sample the same tokens."""
    return zlib.crc32(f"{run_seed}:{group_index}:{index}".encode()) & 0x7FFFFFFF


async def single_turn(ctx: RolloutContext, sample: Sample) -> Sample:
    """The default generate function: one /generate call on the prompt, logprobs returned."""
    params = ctx.sampling.model_copy(
        update={"sampling_seed": sample_seed(ctx.seed, sample.group_index, sample.index)}
    )
    result = await ctx.client.generate(sample.prompt_ids, params, return_logprob=True)
    n = len(result.output_ids)
    sample.response_ids = list(result.output_ids)
    sample.loss_mask = [1] * n
    sample.rollout_logprobs = list(result.output_logprobs) if result.output_logprobs else [0.0] * n
    sample.token_versions = list(result.token_versions)
    sample.status = _FINISH_STATUS.get(result.finish_reason, SampleStatus.COMPLETED)
    if sample.status is SampleStatus.ABORTED:  # named when a whole batch fails (driver.batch_checks)
        sample.metadata["error"] = (
            f"the engine aborted the request: {result.abort_message or 'no reason given'}"
        )
    if result.routed_experts is not None:
        sample.routed_experts = result.routed_experts
    return sample


class RoutedExpertsError(RuntimeError):
    """R3 is on but the engine returned no routing data for a finished request."""


@dataclass(slots=True)
class RoutedExpertsClient:
    """A GenerateBackend that requests routed experts (R3) on every /generate of the wrapped client.

    Other attributes are the wrapped client's, so code that reaches for more than `generate` keeps
    working.
    """

    inner: GenerateBackend
    """The engine client (EngineClient, or any GenerateBackend)."""

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        return_logprob: bool = True,
        logprob_start_len: int = -1,
        return_routed_experts: bool = True,
        rid: str | None = None,
        lora_path: str | None = None,
    ) -> GenerateResult:
        """The wrapped generate with return_routed_experts forced on; raises RoutedExpertsError when a
        request that did not abort comes back without routing data."""
        result = await self.inner.generate(
            input_ids,
            sampling_params,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            return_routed_experts=True,
            rid=rid,
            lora_path=lora_path,
        )
        if result.routed_experts is None and result.finish_reason != "abort":
            raise RoutedExpertsError(
                "R3 is on (spec.algorithm.r3) but the engine returned no meta_info.routed_experts; serve a "
                "MoE model and start SGLang with --enable-return-routed-experts"
            )
        return result

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy, unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


@dataclass(slots=True)
class Rollout:
    """Everything needed to produce scored samples: context, plugins and the chat renderer."""

    ctx: RolloutContext
    """Engine client, sampling params, tokenizer functions, seed."""
    plugins: Plugins
    """Generate, reward and (optional) agent functions."""
    render: Callable[[Sequence[Mapping[str, Any]]], list[int]]
    """Chat messages -> prompt IDs with the generation prompt appended (the family's chat format)."""
    agent_ctx: AgentContext | None = None
    """Context handed to the agent function (None when no agent is configured)."""
    scorer: Callable[[Sample], Awaitable[Sample]] | None = None
    """OPD: the teacher scorer run on every finished, rewarded sample (lockstep.rollout.opd.scorer);
    None without OPD (and for evaluation, which scores the task alone)."""

    async def run_sample(self, sample: Sample) -> Sample:
        """Generate (or run the agent) and score one sample; user-code errors mark it FAILED.

        With a scorer (OPD) the teacher scores the finished sample after its reward; its errors stop
        the run (StopsTheRun), they are not the sample's."""
        sample = await self._run_user_code(sample)
        if self.scorer is not None and sample.status not in (SampleStatus.ABORTED, SampleStatus.FAILED):
            sample = await self.scorer(sample)
        return sample

    async def _run_user_code(self, sample: Sample) -> Sample:
        try:
            if self.plugins.agent is not None and self.agent_ctx is not None:
                sample = await self.plugins.agent(self.agent_ctx, sample)
            else:
                sample = await self.plugins.generate(self.ctx, sample)
            sample.check()
            if sample.status is SampleStatus.ABORTED:
                return sample
            text = self.ctx.decode(
                [t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if m]
            )
            sample.reward = await call_reward(self.plugins.reward, sample, text)
        except (ConnectionError, asyncio.CancelledError, StopsTheRun):
            raise  # an unreachable engine is the driver's business, not a failed sample
        except Exception as e:
            log.warning("sample %d/%d failed: %s: %s", sample.group_index, sample.index, type(e).__name__, e)
            sample.status = SampleStatus.FAILED
            sample.reward = 0.0
            sample.metadata["error"] = f"{type(e).__name__}: {e}"
        return sample

    async def generate_group(
        self, group_index: int, messages: Sequence[Mapping[str, Any]], n: int, metadata: dict[str, Any]
    ) -> Group:
        """Render the prompt once and run `n` samples of it concurrently; returns the complete group."""
        prompt_ids = self.render(messages)
        samples = [
            Sample(group_index=group_index, index=i, prompt_ids=list(prompt_ids), metadata=dict(metadata))
            for i in range(n)
        ]
        done = await asyncio.gather(*(self.run_sample(s) for s in samples))
        return Group(index=group_index, samples=list(done))
