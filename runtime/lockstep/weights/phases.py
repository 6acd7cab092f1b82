"""Where a weight update's time goes: exclusive per-phase wall time of one update (§7.2).

Why it exists: an update's seconds say nothing about what to make faster. Every transport runs the
same stages (gather the shards, convert to HF names, quantize, fill buckets, move bytes, let the
engine load them, pause and resume generation), interleaved bucket by bucket and nested inside one
another (the transfer pulls a bucket, which pulls the converter, which pulls the trainer's gather).
`PhaseTimer` attributes every instant of an update to exactly one phase, the innermost one open at
that instant, so the phases always sum to the update's measured wall time (docs/weights.md,
"Where an update's time goes"). `measure` opens a timer for the outermost call only (a transport
called by `update_members`, the inner transport of a QuantizingTransport): nested calls add to the
same timer, and the outermost stamps the report.

Who calls it: every transport of this package (`measure`, `phase`, `timed`), the pipeline's
hooks, lockstep.weights.transport.update_members; the per-phase metrics reach the driver's progress
report and the WeightChannel status (lockstep.progress).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Final, Protocol, TypeVar

T = TypeVar("T")


class Stamped(Protocol):
    """What a timer stamps: lockstep.weights.transport.TransferReport."""

    seconds: float
    phases: dict[str, float]


R = TypeVar("R", bound=Stamped)

PHASES: Final = (
    "membership",
    "gather",
    "convert",
    "quantize",
    "bucket",
    "encode",
    "transfer",
    "patch",
    "engine_load",
    "commit",
    "pause",
    "resume",
    "other",
)
"""Every phase an update may spend time in:

- membership: finding the engines of the moment and following them (a new group, a new transfer
  plan, a joining engine's copy);
- gather: the trainer's export (FSDP2 `full_tensor`, a TP/EP all-gather) and the pipeline's gather hook;
- convert: trainer names and layout to HF/SGLang's (the per-family converter);
- quantize: the shared quantizer of low-precision serving (QuantizingTransport);
- bucket: packing tensors into buckets, flat buffers, staging (and P2P's resharding and checksums);
- encode: disk-delta's diff, encoding, compression and checksums;
- transfer: bytes on the wire or to the shared disk (collectives, TransferEngine writes, file writes);
- patch: disk-delta's patching of the engines' checkpoint copies (lineage and checksum checks);
- engine_load: waiting for the engines to take the bytes into their weights (the HTTP calls that load);
- commit: making the version visible (flush_cache, /update_weight_version, P2P commits);
- pause / resume: /pause_generation and /continue_generation;
- other: what none of the above covers (the transport's own bookkeeping)."""

METRIC_PREFIX: Final = "update_weights_"
"""Per-phase metrics are `update_weights_<phase>_s` (seconds of the last update)."""

_CURRENT: contextvars.ContextVar[PhaseTimer | None] = contextvars.ContextVar(
    "weight_update_phases", default=None
)


def metric_name(phase: str) -> str:
    """The metric carrying `phase`'s seconds: update_weights_<phase>_s."""
    return f"{METRIC_PREFIX}{phase}_s"


def phases_of(metrics: dict[str, float] | Iterable[tuple[str, float]]) -> dict[str, float]:
    """The per-phase seconds found in a step's metrics (pure), by phase name."""
    items = metrics.items() if isinstance(metrics, dict) else metrics
    return {k[len(METRIC_PREFIX) : -2]: float(v) for k, v in items if k in _METRIC_NAMES}


class PhaseTimer:
    """Exclusive per-phase wall time: at every instant the innermost open phase is charged."""

    __slots__ = ("_clock", "_mark", "_stack", "done", "seconds", "started", "total")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started = clock()
        """Clock reading when the update began."""
        self._mark = self.started
        self._stack: list[str] = ["other"]
        self.seconds: dict[str, float] = {}
        """Phase -> seconds charged so far."""
        self.done = False
        """True once `finish` ran (the outermost measure ended)."""
        self.total = 0.0
        """Wall time from start to finish; equals sum(seconds.values()) up to float rounding."""

    def _charge(self) -> None:
        now = self._clock()
        top = self._stack[-1]
        self.seconds[top] = self.seconds.get(top, 0.0) + (now - self._mark)
        self._mark = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the time inside to `name` (phases opened inside it charge their own time)."""
        if name not in PHASES:
            raise ValueError(f"unknown weight-update phase {name!r}; one of {', '.join(PHASES)}")
        self._charge()
        self._stack.append(name)
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    def timed(self, items: Iterable[T], name: str) -> Iterator[T]:
        """Iterate `items`, charging the time spent producing each item to `name`."""
        it = iter(items)
        while True:
            with self.phase(name):
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item

    def finish(self) -> None:
        """Close the update: charge the time since the last change and fix `total`."""
        self._charge()
        self.total = self._mark - self.started
        self.done = True

    def metrics(self) -> dict[str, float]:
        """update_weights_<phase>_s for every phase that was charged."""
        return {metric_name(p): s for p, s in self.seconds.items()}

    def stamp(self, report: R) -> R:
        """Put the phases (and the total as `seconds`) into the outermost transport's report."""
        if self.done:
            report.seconds = self.total
            report.phases = dict(self.seconds)
        return report


_METRIC_NAMES: Final = frozenset(metric_name(p) for p in PHASES)


def current() -> PhaseTimer | None:
    """The timer of the update in progress in this context, if any."""
    return _CURRENT.get()


@contextlib.contextmanager
def measure(clock: Callable[[], float] = time.monotonic) -> Iterator[PhaseTimer]:
    """The timer of this update: a new one for the outermost call, the running one for nested calls."""
    running = _CURRENT.get()
    if running is not None:
        yield running
        return
    timer = PhaseTimer(clock)
    token = _CURRENT.set(timer)
    try:
        yield timer
    finally:
        _CURRENT.reset(token)
        timer.finish()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """`timer.phase(name)` on the running timer; nothing when no update is being measured."""
    timer = _CURRENT.get()
    if timer is None:
        yield
        return
    with timer.phase(name):
        yield


def charged(timer: PhaseTimer | None, name: str) -> contextlib.AbstractContextManager[None]:
    """`timer.phase(name)`, or nothing without a timer: for code that runs on another thread (an
    event loop) while the thread that measures the update waits for it."""
    return contextlib.nullcontext() if timer is None else timer.phase(name)


def timed(items: Iterable[T], name: str) -> Iterator[T]:
    """`timer.timed(items, name)` on the timer running when iteration starts; plain iteration otherwise."""
    timer = _CURRENT.get()
    if timer is None:
        yield from items
        return
    yield from timer.timed(items, name)
