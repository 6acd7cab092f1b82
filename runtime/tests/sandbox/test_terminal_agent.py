"""The terminal agent end to end: a real engine, the in-process TITO session server, the real `openai`
client and the local sandbox. The model proposes a command as a tool call, the sandbox runs it, its
output returns as the tool result, the test script's exit status is the reward, and a broken sandbox
aborts only that sample."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from lockstep.models.tiny import EOS_ID, chat_tokenizer
from lockstep.rollout.plugins import AgentContext, check_generate, load_function
from lockstep.rollout.terminal import episode_metrics, terminal_agent, tool_text
from lockstep.sandbox import ExecResult, LocalSandbox, LocalSandboxProvider, SandboxConfig
from lockstep.sandbox.landlock import abi_version
from lockstep.serving import EngineClient, SamplingParams
from lockstep.tasks.base import TaskItem
from lockstep.tasks.shell import SANDBOX_KEY, reward
from lockstep.types import Sample, SampleStatus

pytestmark = pytest.mark.skipif(abi_version() < 1, reason="no Landlock in this kernel (Linux >= 5.13)")


def _sample(instruction: str, test: str, setup: str | None = None) -> Sample:
    item = TaskItem(0, ({"role": "user", "content": instruction},), "", {"test": test, "setup": setup})
    return Sample(
        group_index=3, index=1, prompt_ids=[], metadata={"item": item, "test": test, "setup": setup}
    )


async def _episode(
    engine_url: str, provider: LocalSandboxProvider, sample: Sample, timeout_s: float | None = None
) -> Sample:
    tok = chat_tokenizer()
    async with EngineClient(engine_url) as client:
        ctx = AgentContext(
            client=client,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=64),
            decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
            encode=tok.encode,
            max_turns=3,
            timeout_s=timeout_s,
            sandboxes=provider,
        )
        return await terminal_agent(ctx, sample)


@pytest.fixture
def provider(tmp_path: Path) -> LocalSandboxProvider:
    return LocalSandboxProvider(SandboxConfig(image="unused", command_timeout_s=5), tmp_path / "boxes")


async def test_the_command_runs_in_the_sandbox_and_the_test_gives_the_reward(
    engine_url: str, episodes: tuple[str, ...], provider: LocalSandboxProvider
) -> None:
    sample = await _episode(engine_url, provider, _sample("write 7 to ab", '[ "$(cat ab)" = 7 ]'))
    sample.check()
    tok = chat_tokenizer()
    assert tok.decode(sample.prompt_ids + sample.response_ids) == episodes[0]
    summary = sample.metadata[SANDBOX_KEY]
    assert (summary["turns"], summary["commands"], summary["test_exit"]) == (2, 1, 0)
    assert reward(sample, "") == 1.0
    # the second turn's prompt extends the first turn's row, which the engine's prefix cache holds
    assert 0 < summary["cached_tokens"] < summary["prompt_tokens"]
    ratio = episode_metrics([sample])["sandbox_prefix_cache_hit_ratio"]
    assert ratio == summary["cached_tokens"] / summary["prompt_tokens"]
    # Trained tokens are exactly the sampled ones: the two replies and their <|eos|>, nothing of the tool turn.
    trained = [t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if m]
    replies = [*tok.encode('<call>{"name":"sh","arguments":{"cmd":"echo 7 > ab"}}</call>'), EOS_ID]
    assert trained == replies + tok.encode("done") + [EOS_ID]
    assert all(v is None for v, m in zip(sample.token_versions, sample.loss_mask, strict=True) if not m)
    assert sample.metadata["tito_mismatch"] == []
    assert list(provider.base_dir.iterdir()) == []  # type: ignore[union-attr]  # released


async def test_a_failing_test_script_scores_zero(engine_url: str, provider: LocalSandboxProvider) -> None:
    sample = await _episode(engine_url, provider, _sample("write 7 to ab", "[ -d ab ]"))
    assert sample.status is SampleStatus.COMPLETED
    assert sample.metadata[SANDBOX_KEY]["test_exit"] == 1 and reward(sample, "") == 0.0


async def test_the_output_returns_as_the_tool_result(
    engine_url: str, episodes: tuple[str, ...], provider: LocalSandboxProvider
) -> None:
    sample = await _episode(engine_url, provider, _sample("show ab", "true", setup="echo 7 > ab"))
    tok = chat_tokenizer()
    assert tok.decode(sample.prompt_ids + sample.response_ids) == episodes[1]
    tool = tok.encode("<|tool|>7\n")
    at = next(i for i in range(len(sample.response_ids)) if sample.response_ids[i : i + len(tool)] == tool)
    assert sample.loss_mask[at : at + len(tool)] == [0] * len(tool)  # environment text never trains


async def test_an_episode_out_of_time_before_its_first_turn_is_aborted(
    engine_url: str, provider: LocalSandboxProvider
) -> None:
    sample = await _episode(engine_url, provider, _sample("write 7 to ab", "true"), timeout_s=1e-9)
    assert sample.status is SampleStatus.ABORTED
    summary = sample.metadata[SANDBOX_KEY]
    assert (summary["turns"], summary["aborted"], summary.get("deadline")) == (0, "Deadline", True)
    assert list(provider.base_dir.iterdir()) == []  # type: ignore[union-attr]


async def test_a_failing_setup_aborts_only_that_sample(
    engine_url: str, provider: LocalSandboxProvider
) -> None:
    sample = await _episode(
        engine_url, provider, _sample("write 7 to ab", "true", setup="echo broken; exit 3")
    )
    assert sample.status is SampleStatus.ABORTED
    assert sample.response_ids == [] and sample.loss_mask == []
    assert sample.metadata[SANDBOX_KEY]["aborted"] == "SetupFailed"
    assert episode_metrics([sample])["sandbox_aborted_SetupFailed"] == 1.0


class _VanishingSandboxes(LocalSandboxProvider):
    """Real local sandboxes whose directory disappears right after the claim: the sandbox died."""

    @contextlib.asynccontextmanager
    async def claim(self, key: str) -> AsyncIterator[LocalSandbox]:
        async with LocalSandboxProvider.claim(self, key) as box:
            shutil.rmtree(box.root)
            yield box


async def test_a_sandbox_that_dies_aborts_the_sample_not_the_episode_loop(
    engine_url: str, tmp_path: Path
) -> None:
    provider = _VanishingSandboxes(SandboxConfig(image="unused"), tmp_path / "boxes")
    sample = await _episode(engine_url, provider, _sample("write 7 to ab", "true"))
    assert sample.status is SampleStatus.ABORTED
    assert sample.metadata[SANDBOX_KEY]["aborted"] == "ExecFailed"


def test_the_agent_loads_through_the_manifest_contract() -> None:
    check_generate(load_function("lockstep.rollout.terminal:terminal_agent", "spec.agent.agentFunction"), "x")


def test_tool_text_tells_the_model_about_exit_status_timeouts_and_cut_output() -> None:
    assert tool_text(ExecResult(0, "hi\n")) == "hi\n"
    assert tool_text(ExecResult(1, "")) == "[exit 1]"
    assert tool_text(ExecResult(124, "x", timed_out=True, seconds=5.0)) == "x\n[timed out after 5 s]"
    assert tool_text(ExecResult(0, "abc", truncated=True)) == "abc\n[output cut]"
