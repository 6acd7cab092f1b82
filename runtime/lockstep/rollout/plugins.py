"""Extension points: the user's agent, generate and reward functions, named by import path.

Why it exists: RL tasks differ in how a trajectory is produced (single-turn sampling, a multi-turn
agent with tools) and how it is scored. The manifest names user code as "package.module:function"
(spec.agent.agentFunction / generateFunction / rewardFunction); this module loads each one at start,
checks it against its typed contract, and fails with an error naming the manifest field and the fix
rather than failing on the first sample minutes later.

Contracts (all receive the Sample to fill; the Sample carries prompt_ids and metadata):
- GenerateFn: `async def generate(ctx: RolloutContext, sample: Sample) -> Sample` fills
  response_ids, loss_mask, rollout_logprobs, token_versions and status (one model turn).
- AgentFn:    `async def agent(ctx: AgentContext, sample: Sample) -> Sample`, one whole episode
  (may call `ctx.generate` several times, appending environment tokens with loss_mask 0). When set,
  it runs instead of the generate function.
- RewardFn:   `def reward(sample: Sample, response: str) -> float` (or `async def`), where
  `response` is the decoded response text without special tokens. Default: the task's reward.

Who calls it: lockstep.driver.rollout (load_plugins), lockstep.rollout.generate (runs them, and
call_reward), lockstep.rollout.buffer (load_function for spec.agent.groupFilterFunction).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from lockstep.sandbox.base import SandboxProvider
    from lockstep.serving.client import GenerateBackend
    from lockstep.serving.payloads import SamplingParams
    from lockstep.types import Sample


class PluginError(ValueError):
    """A manifest-named function could not be loaded or breaks its contract; names the field."""


@dataclass(slots=True)
class RolloutContext:
    """What a generate function may use."""

    client: GenerateBackend
    """The engine client (token in, token out, with logprobs)."""
    sampling: SamplingParams
    """Sampling parameters from spec.rollout.sampling (a copy per call is the caller's business)."""
    decode: Callable[[list[int]], str]
    """Token IDs -> text without special tokens (the family's tokenizer)."""
    encode: Callable[[str], list[int]]
    """Text -> token IDs (for environment tokens an agent appends)."""
    seed: int = 0
    """Run seed; generate functions derive per-sample sampling seeds from it for reproducibility."""


@dataclass(slots=True)
class AgentContext(RolloutContext):
    """What an agent function may use: everything of RolloutContext plus its episode limits."""

    generate: Callable[[Sample], Awaitable[Sample]] | None = None
    """The configured generate function bound to this context (one model turn)."""
    session_url: str | None = None
    """Base URL of the TITO session server when one runs, else None."""
    max_turns: int | None = None
    """spec.agent.maxTurns."""
    timeout_s: float | None = None
    """spec.agent.timeoutSeconds."""
    sandboxes: SandboxProvider | None = None
    """The job's sandboxes (spec.agent.sandbox): one claimed per episode; None without a sandbox."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form settings for the agent. The driver sets "family" (spec.model.family), which the
    in-process session server of lockstep.rollout.session.local uses for the chat-template rules, and
    "session" (spec.rollout.session, wire form), the defaults of that server's new sessions."""


class GenerateFn(Protocol):
    """One model turn for `sample` (see module doc)."""

    async def __call__(self, ctx: RolloutContext, sample: Sample) -> Sample: ...


class AgentFn(Protocol):
    """One whole episode for `sample` (see module doc)."""

    async def __call__(self, ctx: AgentContext, sample: Sample) -> Sample: ...


class RewardFn(Protocol):
    """Score of a finished sample; may be a coroutine function."""

    def __call__(self, sample: Sample, response: str) -> float | Awaitable[float]: ...


@dataclass(slots=True)
class Plugins:
    """The loaded extension points of one run."""

    generate: GenerateFn
    """The generate function (default: lockstep.rollout.generate:single_turn)."""
    reward: RewardFn
    """The reward function (default: the task's reward)."""
    agent: AgentFn | None = None
    """The agent function, or None for single-turn rollouts."""


def load_function(path: str, field_path: str) -> Callable[..., Any]:
    """Import "package.module:function"; raises PluginError naming `field_path` on any failure."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise PluginError(
            f"{field_path}: {path!r} is not an import path; write it as 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or an error raised while importing user code
        raise PluginError(
            f"{field_path}: cannot import module {module_name!r} ({type(e).__name__}: {e}); "
            "install the package in the image or fix the path"
        ) from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise PluginError(f"{field_path}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise PluginError(f"{field_path}: {path!r} is a {type(fn).__name__}, not a function")
    return fn  # type: ignore[no-any-return]


def _check_arity(fn: Callable[..., Any], n: int, field_path: str, shape: str) -> None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # builtins without signatures: trust the caller
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(required) > n or (len(positional) < n and not varargs):
        raise PluginError(f"{field_path}: {fn.__qualname__} must have the signature {shape}")


def check_generate(fn: Callable[..., Any], field_path: str) -> GenerateFn:
    """Validate a generate (or agent) function: a coroutine function of (ctx, sample)."""
    shape = "async def f(ctx, sample) -> Sample"
    if not inspect.iscoroutinefunction(fn):
        raise PluginError(f"{field_path}: {getattr(fn, '__qualname__', fn)!r} must be {shape} (an async def)")
    _check_arity(fn, 2, field_path, shape)
    return fn


def check_reward(fn: Callable[..., Any], field_path: str) -> RewardFn:
    """Validate a reward function: a callable of (sample, response)."""
    _check_arity(fn, 2, field_path, "def f(sample, response: str) -> float (or async def)")
    return fn


def load_plugins(
    default_generate: GenerateFn,
    default_reward: RewardFn,
    *,
    generate_path: str | None = None,
    reward_path: str | None = None,
    agent_path: str | None = None,
) -> Plugins:
    """Load the manifest-named functions (spec.agent.*), falling back to the defaults."""
    generate = default_generate
    if generate_path:
        field_path = "spec.agent.generateFunction"
        generate = check_generate(load_function(generate_path, field_path), field_path)
    reward = default_reward
    if reward_path:
        field_path = "spec.agent.rewardFunction"
        reward = check_reward(load_function(reward_path, field_path), field_path)
    agent: AgentFn | None = None
    if agent_path:
        field_path = "spec.agent.agentFunction"
        agent = check_generate(load_function(agent_path, field_path), field_path)
    return Plugins(generate=generate, reward=reward, agent=agent)


async def call_reward(fn: RewardFn, sample: Sample, response: str) -> float:
    """Run a sync or async reward function and check it returned a finite number."""
    value = fn(sample, response)
    if inspect.isawaitable(value):
        value = await value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PluginError(f"reward function returned {type(value).__name__}; it must return a float")
    return float(value)
