"""Tests of the fully-async loop over in-process hooks: versions, staleness, retract, eval attribution.

`ToyEngine` is a test workload standing in for the engines' scheduling only: it emits one token per event
loop turn tagged with the weight version it holds, and `publish` pauses it (in-flight trajectories wait,
as with SGLang's pause mode retract), swaps the version and continues, so trajectories span versions
exactly as on the real engine. The real-engine path is covered by test_async_driver.py.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from lockstep.api import RLJob
from lockstep.config.driver import Schedule
from lockstep.driver.fully_async import (
    AsyncLoop,
    AsyncSettings,
)
from lockstep.driver.steps import EvalOutcome
from lockstep.rollout.async_worker import Prompt
from lockstep.rollout.buffer import GroupFilter
from lockstep.trainer.state import DriverState
from lockstep.types import Group, Sample


class ToyEngine:
    """Generates `prompt_ids[-1]` tokens per trajectory, one per loop turn, tagged with its version."""

    def __init__(self) -> None:
        self.version = 0
        self.running = asyncio.Event()
        self.running.set()

    async def __call__(self, sample: Sample) -> Sample:
        for _ in range(sample.prompt_ids[-1]):
            await self.running.wait()  # paused: retracted requests wait, then continue on the new weights
            await asyncio.sleep(0)
            sample.response_ids.append(7)
            sample.loss_mask.append(1)
            sample.rollout_logprobs.append(-0.5)
            sample.token_versions.append(self.version)
        sample.reward = 1.0 if sample.index == 0 else 0.0
        return sample


class Hooks:
    """In-process hooks: record what the loop asked for."""

    def __init__(self, engine: ToyEngine) -> None:
        self.engine = engine
        self.trained: list[list[int]] = []
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.eval_logged: list[tuple[int, dict[str, float]]] = []
        self.saved: list[DriverState] = []
        self.eval_gate: asyncio.Event | None = None

    def train(self, groups: list[Group], step: int) -> dict[str, float]:
        assert all(len(g.samples) == 2 for g in groups)  # complete groups only
        self.trained.append([g.index for g in groups])
        return {"loss": 0.1 * step}

    async def update_weights(self, version: int) -> dict[str, float]:
        self.engine.running.clear()  # pause(mode=retract)
        await asyncio.sleep(0)
        self.engine.version = version  # push
        self.engine.running.set()  # continue
        return {"payload_bytes": 10.0}

    async def evaluate(self, version: int) -> EvalOutcome:
        seen = {self.engine.version}
        if self.eval_gate is not None:
            await self.eval_gate.wait()
        seen.add(self.engine.version)
        return EvalOutcome({"reward_mean": version / 10}, seen)

    def save(self, state: DriverState) -> None:
        self.saved.append(state)

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        (self.logged if kind == "train" else self.eval_logged).append((step, metrics))


def long_tail_prompts(start: int = 0) -> Iterator[Prompt]:
    """Most trajectories 4 tokens, every 5th one 40 (a long tail)."""
    for i in itertools.count(start):
        yield Prompt([1, 40 if i % 5 == 0 else 4])


SCHEDULE_KEYS = (
    "steps",
    "batch_groups",
    "samples_per_prompt",
    "update_interval",
    "save_interval",
    "eval_interval",
)


def settings(**kw: object) -> AsyncSettings:
    """Steps 6, 2 groups of 2, 8 in flight; `kw` overrides schedule and async knobs alike."""
    base: dict[str, object] = {"steps": 6, "batch_groups": 2, "samples_per_prompt": 2, "max_in_flight": 8}
    base.update(kw)
    schedule = Schedule(**{k: v for k, v in base.items() if k in SCHEDULE_KEYS})  # type: ignore[arg-type]
    rest = {k: v for k, v in base.items() if k not in SCHEDULE_KEYS}
    return AsyncSettings(schedule=schedule, **rest)  # type: ignore[arg-type]


async def test_loop_trains_updates_weights_and_measures() -> None:
    engine = ToyEngine()
    hooks = Hooks(engine)
    loop = AsyncLoop(settings(save_interval=3), hooks, engine, long_tail_prompts())
    state = await loop.run()
    assert state.step == 6 and state.version == 6 and engine.version == 6
    assert len(hooks.trained) == 6 and all(len(b) == 2 for b in hooks.trained)
    flat = [i for b in hooks.trained for i in b]
    assert len(set(flat)) == len(flat)  # each group trained once
    assert [s for s, _ in hooks.logged] == [1, 2, 3, 4, 5, 6]  # steps done, as the sync loop logs them
    last = hooks.logged[-1][1]
    for key in (
        "queue_size",
        "stale_groups_filtered",
        "in_flight",
        "weight_version_sample_coverage",
        "staleness_s_old_mean",
        "mixed_version_ratio",
        "staleness_token_weighted_mean",
        "rollout_samples_per_s",
        "trained_samples_per_s",
    ):
        assert key in last
    assert last["weight_version_sample_coverage"] == 1.0
    # Long trajectories outlive weight updates: some consumed group carries tokens of two versions.
    assert loop.run_stats.mixed_groups > 0
    assert max(loop.run_stats.s_old) >= 1
    assert [s.step for s in hooks.saved] == [3, 6]
    assert loop.trained_samples == 6 * 2 * 2
    assert hooks.saved[-1].next_group_index >= 12


async def test_staleness_bound_drops_groups() -> None:
    engine = ToyEngine()
    hooks = Hooks(engine)
    loop = AsyncLoop(settings(max_staleness=0, max_in_flight=12), hooks, engine, long_tail_prompts())
    await loop.run()
    assert max(loop.run_stats.s_old) == 0  # nothing older than the bound was trained on
    dropped = hooks.logged[-1][1]["stale_groups_filtered"]
    assert dropped > 0


async def test_the_state_announced_to_a_trainer_group_leaves_out_dropped_groups() -> None:
    """Before each train the loop announces the state after that step (a trainer group checkpoints it
    on SIGTERM). It must equal what the loop itself saves after that step: a group dropped as stale at
    the step's get is decided (counted, not pending), else a resume would generate it again."""
    engine = ToyEngine()
    hooks = Hooks(engine)
    announced: list[DriverState] = []
    prompts = (Prompt([1, 40 if i % 5 == 0 else 4], position=i) for i in itertools.count())
    loop = AsyncLoop(
        settings(max_staleness=0, max_in_flight=12, save_interval=1), hooks, engine, prompts,
        announce=announced.append,
    )  # fmt: skip
    await loop.run()
    assert [a.step for a in announced] == [s.step for s in hooks.saved] == [1, 2, 3, 4, 5, 6]
    assert hooks.saved[-1].group_counts["stale_groups_filtered"] > 0  # the bound dropped groups
    for a, saved in zip(announced, hooks.saved, strict=True):
        # no get (so no stale drop) between the announcement and the save; groups submitted meanwhile
        # are pending in the save only
        assert {gi for gi, _ in a.pending_groups} <= {gi for gi, _ in saved.pending_groups}, (a, saved)
        assert a.group_counts == saved.group_counts and a.version == saved.version, (a, saved)
        assert a.group_counts["consumed_groups"] == 2 * a.step


async def test_a_saved_or_announced_state_never_hands_out_a_pending_groups_index_again() -> None:
    """A resume draws new groups from next_group_index on while it regenerates the pending ones under
    their own indices: an index of both would overwrite a pending group's position, and its prompt would
    be drawn but never trained (found on the real node: a SIGTERM checkpoint of the announced state)."""
    engine = ToyEngine()
    hooks = Hooks(engine)
    announced: list[DriverState] = []
    prompts = (Prompt([1, 4], position=i) for i in itertools.count())
    loop = AsyncLoop(
        settings(max_in_flight=12, save_interval=1), hooks, engine, prompts, announce=announced.append
    )
    await loop.run()
    states = [*announced, *hooks.saved]
    assert states and any(s.pending_groups for s in states)
    for st in states:
        assert all(gi < st.next_group_index for gi, _ in st.pending_groups), st


async def test_eval_attributed_to_its_step_with_latency() -> None:
    engine = ToyEngine()
    hooks = Hooks(engine)
    hooks.eval_gate = asyncio.Event()
    loop = AsyncLoop(settings(eval_interval=2, eval_pins_version=False), hooks, engine, long_tail_prompts())

    async def release_late(step: int, metrics: dict[str, float]) -> None:
        if step == 5 and hooks.eval_gate is not None:
            hooks.eval_gate.set()  # the eval launched after step 2 returns only now, steps later

    loop.on_step = release_late
    await loop.run()
    by_step = {r.step: r for r in loop.evals}
    assert set(by_step) == {2, 4, 6}
    assert by_step[2].version == 2 and by_step[2].metrics == {"reward_mean": 0.2}
    assert by_step[2].mixed_versions  # unpinned: the engines moved on while it ran, and it says so
    assert sorted(s for s, _ in hooks.eval_logged) == [2, 4, 6]  # each on its own step, however late
    assert all(m["eval_latency_s"] >= 0.0 and m["weight_version"] == s for s, m in hooks.eval_logged)
    assert dict(hooks.eval_logged)[2]["mixed_versions"] == 1.0


async def test_pinned_eval_never_mixes_versions() -> None:
    engine = ToyEngine()
    hooks = Hooks(engine)
    loop = AsyncLoop(settings(eval_interval=1), hooks, engine, long_tail_prompts())
    await loop.run()
    assert len(loop.evals) == 6
    assert not any(r.mixed_versions for r in loop.evals)
    assert [(r.step, r.version) for r in sorted(loop.evals, key=lambda r: r.step)] == [
        (k, k) for k in range(1, 7)
    ]


async def test_resume_continues_from_state() -> None:
    engine = ToyEngine()
    engine.version = 3
    hooks = Hooks(engine)
    counts = {"consumed_groups": 6, "stale_groups_filtered": 5}
    state = DriverState(step=3, version=3, next_group_index=40, prompts_consumed=40, group_counts=counts)
    loop = AsyncLoop(settings(), hooks, engine, long_tail_prompts(40), state=state)
    end = await loop.run()
    assert end.step == 6 and end.version == 6
    assert min(i for b in hooks.trained for i in b) >= 40
    assert [s for s, _ in hooks.logged] == [4, 5, 6]
    assert [s.step for s in hooks.saved] == [6]  # always saved at the end
    # staleness is measured against the resumed version: the first step's groups are fresh
    assert hooks.logged[0][1]["staleness_s_old_max"] == 0.0
    # the buffer's run counters count on from the checkpoint's, and the next checkpoint carries them
    assert [m["consumed_groups"] for _, m in hooks.logged] == [8, 10, 12]
    assert [m["stale_groups_filtered"] for _, m in hooks.logged] == [5, 5, 5]
    assert hooks.saved[-1].group_counts == {**counts, "consumed_groups": 12, "aborted_groups_filtered": 0,
                                            "filtered_groups": 0}  # fmt: skip


def test_settings_checked() -> None:
    with pytest.raises(ValueError, match="maxInFlight"):
        settings(max_in_flight=1)
    with pytest.raises(ValueError, match="batch_groups"):
        settings(batch_groups=0)
    assert settings().capacity == 4
    assert settings(buffer_groups=7).capacity == 7


async def test_run_ends_when_prompts_run_out() -> None:
    engine = ToyEngine()
    hooks = Hooks(engine)
    prompts = itertools.islice(long_tail_prompts(), 5)  # 2 full batches of 2 groups, then 1 group left over
    loop = AsyncLoop(settings(), hooks, engine, prompts)
    state = await loop.run()
    assert state.step == 2
    assert [s.step for s in hooks.saved] == [2]


async def test_unreachable_engine_fails_the_run_without_saving() -> None:
    engine = ToyEngine()
    hooks = Hooks(engine)

    async def unreachable(sample: Sample) -> Sample:
        raise ConnectionError("engine unreachable")

    loop = AsyncLoop(settings(), hooks, unreachable, long_tail_prompts())
    with pytest.raises(ConnectionError, match="engine unreachable"):  # its own type: the CLI maps it
        await loop.run()
    assert hooks.saved == []


def test_async_settings_golden() -> None:
    from lockstep.api import ManifestError, load_manifest
    from lockstep.config.driver import async_settings, run_settings

    text = (Path(__file__).parent / "fixtures" / "tiny-async.yaml").read_text()
    job = load_manifest(text)
    got = async_settings(job, run_settings(job, steps=5).schedule)
    assert got == AsyncSettings(
        schedule=Schedule(
            steps=5,
            batch_groups=4,
            samples_per_prompt=4,
            update_interval=1,
            eval_interval=2,
            save_interval=None,
        ),
        max_in_flight=24,
        max_staleness=2,
        buffer_groups=None,
        sample_timeout_s=None,
    )
    assert got.capacity == 8
    sized = text.replace("  schedule:\n", "  schedule:\n    bufferGroups: 3\n")
    job = load_manifest(sized)
    assert async_settings(job, run_settings(job).schedule).capacity == 3
    with pytest.raises(ManifestError, match="bufferGroups"):
        load_manifest(sized.replace("bufferGroups: 3", "bufferGroups: 0"))


def test_staleness_metrics_flatten_histograms() -> None:
    from lockstep.driver.fully_async import staleness_metrics
    from lockstep.rollout.staleness import StalenessStats, measure_staleness

    stats = StalenessStats()
    stats.add(measure_staleness([*([12] * 300), *([13] * 100)], 14))
    m = staleness_metrics(stats)
    assert m["staleness_s_old_hist_2"] == 1.0
    assert m["staleness_s_post_hist_1"] == 1.0
    assert m["staleness_delta_gen_hist_1"] == 1.0
    assert m["staleness_token_weighted_hist_1.75"] == 1.0
    assert m["staleness_s_old_mean"] == 2.0 and m["mixed_version_ratio"] == 1.0
    assert all("/" not in k for k in m)  # flat names, like every other metric of the run
    stats.add(measure_staleness([0], 30))
    stats.add(measure_staleness([2], 40))
    m = staleness_metrics(stats)
    assert m["staleness_s_old_hist_ge16"] == 2.0  # one bucket for everything >= 16 versions
    assert m["staleness_token_weighted_hist_ge16"] == 2.0


def test_group_filter_from_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lockstep.api import load_manifest
    from lockstep.config.driver import run_config
    from lockstep.driver.fully_async import group_filters

    def filters_for_job(job: RLJob) -> tuple[GroupFilter, ...]:
        return group_filters(run_config(job).agent.group_filter_function)

    (tmp_path / "my_async_filters.py").write_text("def keep_all(group):\n    return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    text = (Path(__file__).parent / "fixtures" / "tiny-async.yaml").read_text()
    assert filters_for_job(load_manifest(text)) == ()

    def with_filter(path: str) -> str:
        return text.replace("  data:\n", f"  agent:\n    groupFilterFunction: {path}\n  data:\n")

    (keep,) = filters_for_job(load_manifest(with_filter("my_async_filters:keep_all")))
    assert keep(Group(0, [])) is True
    with pytest.raises(ValueError, match="groupFilterFunction"):
        filters_for_job(load_manifest(with_filter("my_async_filters:missing")))
