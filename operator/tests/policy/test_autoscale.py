"""Golden tests of the RolloutPool autoscaling policy (pure; the clock is a number)."""

from __future__ import annotations

from lockstep_operator.policy.autoscale import QueueSample, ScalePolicy, decide_replicas

POLICY = ScalePolicy(min_replicas=1, max_replicas=4, window_s=60, cooldown_s=100)


def samples(
    sizes: list[int], *, start: float = 0.0, every: float = 20.0, cap: int = 100
) -> list[QueueSample]:
    return [
        QueueSample(at=start + i * every, step=i + 1, queue_size=s, capacity=cap) for i, s in enumerate(sizes)
    ]


def decide(current: int, s: list[QueueSample], now: float, **kw: object) -> tuple[int, str]:
    kw.setdefault("last_scaled_at", None)
    kw.setdefault("last_scaled_step", None)
    d = decide_replicas(current=current, policy=POLICY, samples=s, now=now, **kw)  # type: ignore[arg-type]
    return d.replicas, d.reason


def test_starving_trainer_scales_up() -> None:
    assert decide(2, samples([0, 1, 0, 2, 0]), now=80)[0] == 3


def test_pinned_queue_scales_down() -> None:
    assert decide(2, samples([99, 100, 100, 98, 100]), now=80)[0] == 1


def test_mixed_queue_holds() -> None:
    assert decide(2, samples([0, 50, 0, 0, 0]), now=80) == (2, "queue within bounds")


def test_bounds() -> None:
    assert decide(4, samples([0, 0, 0, 0, 0]), now=80)[0] == 4
    assert decide(1, samples([100] * 5), now=80)[0] == 1
    assert decide(7, [], now=0)[0] == 4


def test_cooldown_and_step_boundary() -> None:
    s = samples([0, 0, 0, 0, 0])
    assert "cooldown" in decide(2, s, now=80, last_scaled_at=50)[1]
    assert "step boundary" in decide(2, s, now=80, last_scaled_at=-500, last_scaled_step=5)[1]
    assert decide(2, s, now=80, last_scaled_at=-500, last_scaled_step=4)[0] == 3


def test_short_history_holds() -> None:
    assert "history" in decide(2, samples([0, 0], start=50), now=80)[1]
