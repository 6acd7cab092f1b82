"""The client's request gate on a fake clock: at most `limit` requests in flight, the urgent ones go
first, each class in arrival order, the others get fewer slots while urgent ones are in flight, an
overdue one goes next whatever its class, a cancelled waiter
neither blocks nor leaks its slot, and with nothing waiting a request goes at once. Nothing sleeps."""

from __future__ import annotations

import asyncio

import pytest
from lockstep_operator.k8s.gate import RequestGate


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


class Requests:
    """Requests that hold their slot until released; `order` is the order they got one."""

    def __init__(self, gate: RequestGate) -> None:
        self.gate = gate
        self.order: list[str] = []
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._done: dict[str, asyncio.Event] = {}

    def send(self, name: str, urgent: bool) -> None:
        self._done[name] = asyncio.Event()
        self.tasks[name] = asyncio.get_running_loop().create_task(self._one(name, urgent))

    async def _one(self, name: str, urgent: bool) -> None:
        async with self.gate.slot(urgent):
            self.order.append(name)
            await self._done[name].wait()

    async def finish(self, name: str) -> None:
        self._done[name].set()
        await settle()


async def test_at_most_limit_in_flight_and_urgent_ones_first() -> None:
    gate = RequestGate(4, max_wait_s=5.0, clock=Clock(), other_limit=2, busy_other_limit=2)
    r = Requests(gate)
    sent = [
        ("a", False),
        ("b", False),
        ("c", False),
        ("d", True),
        ("e", False),
        ("f", True),
        ("g", True),
        ("h", True),
    ]
    for name, urgent in sent:
        r.send(name, urgent)
    await settle()
    assert r.order == ["a", "b", "d", "f"]  # c and e wait: two others are in flight already
    assert (gate.in_flight, gate.other_in_flight, gate.waiting) == (4, 2, 4)
    await r.finish("a")
    await r.finish("b")
    assert r.order[4:] == ["g", "h"]  # the urgent ones pass the older others
    await r.finish("d")
    await r.finish("f")
    assert r.order[6:] == ["c", "e"]  # then the others in arrival order
    for name in ("g", "h", "c", "e"):
        await r.finish(name)
    assert (gate.in_flight, gate.other_in_flight, gate.waiting) == (0, 0, 0)


async def test_others_never_take_the_slots_kept_for_urgent_requests() -> None:
    gate = RequestGate(4, clock=Clock(), other_limit=2, busy_other_limit=2)
    r = Requests(gate)
    for name in ("a", "b", "c"):
        r.send(name, False)
    await settle()
    assert r.order == ["a", "b"] and gate.waiting == 1  # two slots stay free with nothing urgent
    r.send("pod", True)
    await settle()
    assert r.order == ["a", "b", "pod"]
    await r.finish("a")
    assert r.order[-1] == "c"


async def test_while_urgent_requests_are_in_flight_the_others_get_fewer_slots() -> None:
    gate = RequestGate(8, clock=Clock(), other_limit=4, busy_other_limit=1)
    r = Requests(gate)
    for name in ("a", "b", "c", "d", "e"):
        r.send(name, False)
    await settle()
    assert r.order == ["a", "b", "c", "d"]  # nothing urgent: the others take their half
    r.send("pod", True)
    await settle()
    assert r.order[-1] == "pod"
    for name in ("a", "b", "c"):
        await r.finish(name)
    assert r.order == ["a", "b", "c", "d", "pod"]  # e waits: d is the one other allowed beside a pod
    await r.finish("d")
    assert r.order[-1] == "e"  # one other at a time while the pod is on the wire
    r.send("f", False)
    await settle()
    assert gate.waiting == 1
    await r.finish("pod")
    assert r.order[-1] == "f"  # the urgent request is done: the others get their half again
    for name in ("e", "f"):
        await r.finish(name)
    assert (gate.in_flight, gate.other_in_flight, gate.waiting) == (0, 0, 0)


async def test_an_overdue_request_goes_next_whatever_its_class() -> None:
    clock = Clock()
    gate = RequestGate(1, max_wait_s=5.0, clock=clock)
    r = Requests(gate)
    r.send("held", True)
    await settle()
    r.send("config-map", False)
    r.send("pod-1", True)
    await settle()
    clock.now = 5.0  # the ConfigMap has waited max_wait_s
    r.send("pod-2", True)
    await r.finish("held")
    assert r.order == ["held", "config-map"]
    await r.finish("config-map")
    assert r.order == ["held", "config-map", "pod-1"]


async def test_a_cancelled_waiter_neither_blocks_nor_leaks_its_slot() -> None:
    gate = RequestGate(1, clock=Clock())
    r = Requests(gate)
    r.send("held", True)
    r.send("cancelled", True)
    r.send("next", False)
    await settle()
    r.tasks["cancelled"].cancel()
    await settle()
    assert gate.waiting == 1
    await r.finish("held")
    assert r.order == ["held", "next"] and gate.in_flight == 1
    await r.finish("next")
    assert gate.in_flight == 0


async def test_a_request_that_raises_gives_its_slot_back() -> None:
    gate = RequestGate(1, clock=Clock())
    with pytest.raises(RuntimeError):
        async with gate.slot(True):
            raise RuntimeError("the API server refused it")
    assert gate.in_flight == 0
    async with gate.slot(False):  # goes at once: nothing waits, a slot is free
        assert gate.in_flight == 1


def test_a_limit_below_one_is_refused_and_others_get_half_or_one_slot_while_busy() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        RequestGate(0)
    assert (RequestGate(32).other_limit, RequestGate(32).busy_other_limit) == (16, 1)
    assert (RequestGate(64).other_limit, RequestGate(64).busy_other_limit) == (32, 2)
    assert (RequestGate(1).other_limit, RequestGate(1).busy_other_limit) == (1, 1)
