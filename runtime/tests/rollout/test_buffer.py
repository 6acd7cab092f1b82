"""Tests of the bounded group buffer: checks at put, staleness at get, back-pressure, close."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from lockstep.rollout.buffer import BufferClosed, GroupBuffer, load_group_filter
from lockstep.types import Group, Sample, SampleStatus


def make_group(
    index: int, versions: list[int | None], status: SampleStatus = SampleStatus.COMPLETED
) -> Group:
    """A group of two samples whose generated tokens carry `versions` (split across the samples)."""
    half = len(versions) // 2
    samples = []
    for i, vs in enumerate((versions[:half], versions[half:])):
        n = len(vs)
        samples.append(
            Sample(index, i, [1, 2], list(range(n)), [1] * n, [-0.5] * n, list(vs), reward=float(i))
        )
    samples[1].status = status
    return Group(index, samples)


async def test_fifo_order_and_staleness_at_get() -> None:
    buf = GroupBuffer(capacity=4)
    await buf.put(make_group(0, [0, 0]))
    await buf.put(make_group(1, [0, 1]))
    await buf.set_version(2)
    a, b = await buf.get_batch(2)
    assert [a.group.index, b.group.index] == [0, 1]
    assert (a.staleness.s_old, b.staleness.s_old, b.staleness.s_post, b.staleness.delta_gen) == (2, 2, 1, 1)
    w = buf.take_window()
    assert w.s_old == {2: 2}
    assert buf.take_window().groups == 0


async def test_seed_example_bound_at_get() -> None:
    # §5: a group of v12/v13 tokens consumed at 14 is rejected under bound 1, accepted under 2.
    versions: list[int | None] = [*([12] * 300), *([13] * 100)]
    strict = GroupBuffer(capacity=2, max_staleness=1, version=12)
    loose = GroupBuffer(capacity=2, max_staleness=2, version=12)
    for buf in (strict, loose):
        await buf.put(make_group(7, versions))
        await buf.put(make_group(8, [14, 14]))
        await buf.set_version(14)
    got = await strict.get()
    assert got.group.index == 8  # group 7 was dropped as stale
    assert strict.counters.stale_groups_filtered == 1
    got = await loose.get()
    assert got.group.index == 7 and got.staleness.token_weighted == pytest.approx(1.75)
    assert loose.counters.stale_groups_filtered == 0


async def test_staleness_checked_at_get_not_put() -> None:
    buf = GroupBuffer(capacity=2, max_staleness=0)
    await buf.put(make_group(0, [0, 0]))  # fresh when put
    await buf.set_version(1)  # ... one update later it is stale
    await buf.put(make_group(1, [1, 1]))
    assert (await buf.get()).group.index == 1
    assert buf.metrics()["stale_groups_filtered"] == 1.0


async def test_unversioned_group_never_stale() -> None:
    buf = GroupBuffer(capacity=2, max_staleness=0)
    await buf.put(make_group(0, [None, None]))
    await buf.set_version(9)
    got = await buf.get()
    assert got.group.index == 0 and got.staleness.coverage == 0.0


@pytest.mark.parametrize("status", [SampleStatus.ABORTED, SampleStatus.FAILED])
async def test_aborted_and_failed_dropped_at_put(status: SampleStatus) -> None:
    buf = GroupBuffer(capacity=2)
    assert await buf.put(make_group(0, [0, 0], status)) is False
    assert await buf.put(make_group(1, [0, 0], SampleStatus.TRUNCATED)) is True
    assert buf.queue_size == 1
    assert buf.counters.aborted_groups_filtered == 1
    assert buf.metrics()["aborted_groups_filtered"] == 1.0


async def test_user_filter_by_import_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_group_filters.py").write_text(
        "def keep_varied(group):\n    return len(set(group.rewards)) > 1\n"
        "def keep_none(group):\n    return False\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    buf = GroupBuffer(capacity=2, filters=[load_group_filter("my_group_filters:keep_varied")])
    assert await buf.put(make_group(0, [0, 0])) is True  # rewards 0.0 and 1.0 differ
    same = make_group(1, [0, 0])
    same.samples[1].reward = 0.0
    assert await buf.put(same) is False
    assert buf.counters.filtered_groups == 1
    assert load_group_filter("my_group_filters.keep_none")(same) is False


@pytest.mark.parametrize(
    "path", ["nodots", "no_such_module_xyz:f", "my_group_filters2:missing", "my_group_filters2:X"]
)
def test_bad_filter_path_is_a_clear_error(path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_group_filters2.py").write_text("X = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="group filter"):
        load_group_filter(path)


async def test_producer_blocks_when_full() -> None:
    buf = GroupBuffer(capacity=1)
    await buf.put(make_group(0, [0, 0]))
    pending = asyncio.create_task(buf.put(make_group(1, [0, 0])))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not pending.done()  # back-pressure: the queue is at capacity
    assert buf.queue_size == 1
    assert (await buf.get()).group.index == 0
    assert await pending is True
    assert buf.queue_size == 1


async def test_close_wakes_waiters_and_drains() -> None:
    buf = GroupBuffer(capacity=1)
    getter = asyncio.create_task(buf.get())
    await asyncio.sleep(0)
    await buf.close()
    with pytest.raises(BufferClosed):
        await getter
    buf2 = GroupBuffer(capacity=1)
    await buf2.put(make_group(0, [0, 0]))
    blocked = asyncio.create_task(buf2.put(make_group(1, [0, 0])))
    await asyncio.sleep(0)
    await buf2.close()
    with pytest.raises(BufferClosed):
        await blocked
    assert (await buf2.get()).group.index == 0  # queued groups stay readable


def test_bad_config_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="capacity"):
        GroupBuffer(capacity=0)
    with pytest.raises(ValueError, match="maxWeightStaleness"):
        GroupBuffer(capacity=1, max_staleness=-1)


async def test_version_never_goes_back() -> None:
    buf = GroupBuffer(capacity=1, version=3)
    with pytest.raises(ValueError, match="backwards"):
        await buf.set_version(2)
