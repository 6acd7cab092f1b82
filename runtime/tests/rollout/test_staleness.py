"""Golden tests of the staleness measures of §5, including every worked example there."""

from __future__ import annotations

import pytest
from lockstep.rollout.staleness import Staleness, StalenessStats, is_too_stale, measure_staleness
from lockstep.types import Group, Sample


def seed_example() -> list[int | None]:
    """The trajectory of §5's example: first half decoded at version 12, second half at 13 (300 + 100 tokens)."""
    return [*([12] * 300), *([13] * 100)]


def test_seed_example_three_measures() -> None:
    # §5: versions 12 and 13 consumed at 14 -> S_old=2, S_post=1, delta_gen=1.
    r = measure_staleness(seed_example(), current_version=14)
    assert (r.s_old, r.s_post, r.delta_gen) == (2, 1, 1)
    assert (r.oldest_version, r.newest_version) == (12, 13)
    assert r.mixed


def test_seed_example_token_weighted() -> None:
    # §5: 300 tokens of v12 + 100 of v13 -> mean 12.25, token-weighted staleness 1.75.
    r = measure_staleness(seed_example(), current_version=14)
    assert r.mean_version == pytest.approx(12.25)
    assert r.token_weighted == pytest.approx(1.75)


@pytest.mark.parametrize(("bound", "rejected"), [(1, True), (2, False), (None, False), (0, True), (3, False)])
def test_seed_example_bound(bound: int | None, rejected: bool) -> None:
    # §5: --max-weight-staleness 1 rejects the example group, 2 accepts it (strictly greater).
    r = measure_staleness(seed_example(), current_version=14)
    assert is_too_stale(r, bound) is rejected


def test_unversioned_tokens_left_out() -> None:
    versions: list[int | None] = [None] * 100 + [12] * 300 + [13] * 100
    r = measure_staleness(versions, current_version=14)
    assert (r.s_old, r.s_post, r.delta_gen) == (2, 1, 1)
    assert r.token_weighted == pytest.approx(1.75)
    assert r.versioned_tokens == 400
    assert r.total_tokens == 500
    assert r.coverage == pytest.approx(0.8)


def test_group_without_versions_never_rejected() -> None:
    r = measure_staleness([None, None, None], current_version=50)
    assert r.s_old is None and r.token_weighted is None
    assert r.coverage == 0.0
    assert not r.mixed
    assert is_too_stale(r, 0) is False


def test_empty_group() -> None:
    r = measure_staleness([], current_version=3)
    assert r.total_tokens == 0 and r.coverage == 0.0
    assert is_too_stale(r, 0) is False


def test_fresh_single_version() -> None:
    r = measure_staleness([5, 5, 5], current_version=5)
    assert (r.s_old, r.s_post, r.delta_gen, r.token_weighted) == (0, 0, 0, 0.0)
    assert not r.mixed
    assert is_too_stale(r, 0) is False


def test_future_version_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="token_versions holds version 15"):
        measure_staleness([14, 15], current_version=14)


def test_negative_bound_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        is_too_stale(measure_staleness([1], 2), -1)
    with pytest.raises(ValueError, match="max_staleness"):  # also when the group carries no version
        is_too_stale(measure_staleness([None], 2), -1)


def test_group_token_versions_feed_measure() -> None:
    # Environment tokens (loss_mask 0) carry no version and are not generated tokens: Group leaves them out.
    s0 = Sample(0, 0, [1], [7, 8, 9], [1, 0, 1], [-0.1, 0.0, -0.2], [12, None, 13])
    s1 = Sample(0, 1, [1], [7, 8], [1, 1], [-0.1, -0.3], [12, 12])
    r = measure_staleness(Group(0, [s0, s1]).token_versions(), current_version=14)
    assert (r.s_old, r.s_post, r.delta_gen) == (2, 1, 1)
    assert r.total_tokens == 4 and r.versioned_tokens == 4


def test_stats_histograms_and_summary() -> None:
    stats = StalenessStats()
    stats.add(measure_staleness(seed_example(), 14))  # S_old 2, S_post 1, delta 1, tw 1.75
    stats.add(measure_staleness([14, 14], 14))  # all zero
    stats.add(measure_staleness([None], 14))  # unversioned
    assert stats.s_old == {2: 1, 0: 1}
    assert stats.s_post == {1: 1, 0: 1}
    assert stats.delta_gen == {1: 1, 0: 1}
    assert stats.token_weighted == {1.75: 1, 0.0: 1}
    s = stats.summary()
    assert s["staleness_s_old_mean"] == pytest.approx(1.0)
    assert s["staleness_s_old_max"] == 2.0
    assert s["mixed_version_ratio"] == pytest.approx(0.5)
    assert s["weight_version_sample_coverage"] == pytest.approx(402 / 403)
    assert s["staleness_token_weighted_mean"] == pytest.approx(0.875)
    total = StalenessStats()
    total.merge(stats)
    total.merge(stats)
    assert total.s_old == {2: 2, 0: 2}
    assert total.groups == 6


def test_result_is_immutable() -> None:
    r: Staleness = measure_staleness([1], 1)
    with pytest.raises(AttributeError):
        r.s_old = 3  # type: ignore[misc]
