"""The run's rollout: sampling parameters, the engine client it samples through, and the plugins.

Why it exists: what a sample is made of (§2: generate, reward, the agent and its sandboxes) is built
from the RunConfig in one place: the client (R3 and a LoRA adapter wrap it), the sampling params of
the tokenizer's stop tokens, the user's or the default plugins (validated now, named by manifest
field) and the multi-turn agent's context.

Who calls it: lockstep.driver.components.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from lockstep.config.driver import RunConfig
from lockstep.driver.engines import PoolClient
from lockstep.driver.lora import sampling_client
from lockstep.rollout.generate import Rollout, RoutedExpertsClient, single_turn
from lockstep.rollout.plugins import AgentContext, RolloutContext, load_plugins
from lockstep.serving.membership import session_members
from lockstep.serving.payloads import SamplingParams

if TYPE_CHECKING:
    from lockstep.models import ChatTokenizer
    from lockstep.sandbox.base import SandboxProvider
    from lockstep.serving.client import EngineClient
    from lockstep.tasks import Task
    from lockstep.types import Sample


def build_rollout(
    config: RunConfig,
    tokenizer: ChatTokenizer,
    task: Task,
    clients: list[EngineClient],
    sandboxes: SandboxProvider | None = None,
) -> Rollout:
    """Sampling params, the rollout context and the plugins (validated now, named by manifest field)."""
    settings, agent = config.settings, config.agent
    sampling = SamplingParams(
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        stop_token_ids=list(tokenizer.stop_token_ids),
    )
    ctx = RolloutContext(
        # R3: every /generate asks for the routed experts; an engine that returns none is refused.
        client=sampling_client(
            config.adapter, RoutedExpertsClient(PoolClient(clients)) if config.r3 else PoolClient(clients)
        ),
        sampling=sampling,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        encode=tokenizer.encode,
        seed=settings.seed,
    )

    def task_reward(sample: Sample, response: str) -> float:
        return task.reward(response, sample.metadata["item"])

    plugins = load_plugins(
        single_turn,
        task_reward,
        generate_path=agent.generate_function,
        reward_path=agent.reward_function,  # a sandbox job: the terminal agent and its test by default
        agent_path=agent.agent_function,
    )
    agent_ctx = None
    if plugins.agent is not None:
        agent_ctx = AgentContext(
            ctx.client,
            sampling,
            ctx.decode,
            ctx.encode,
            settings.seed,
            max_turns=agent.max_turns,
            timeout_s=agent.timeout_s,
            sandboxes=sandboxes,
            # The session server renders turns with the family's chat-template rules (TITO) and the
            # checkpoint's own tokenizer; its new sessions default to spec.rollout.session.
            extra={
                "family": agent.family,
                "tokenizer_dir": tokenizer.source,
                "session": agent.session,
                # a driver pod: sessions stick to one live engine pod (and DP-attention rank)
                "members": session_members(os.environ),
                "dp_size": agent.dp_size,
            },
        )
        agent_ctx.generate = lambda s: plugins.generate(ctx, s)
    render = lambda msgs: tokenizer.render(msgs, add_generation_prompt=True)  # noqa: E731
    return Rollout(ctx=ctx, plugins=plugins, render=render, agent_ctx=agent_ctx)
