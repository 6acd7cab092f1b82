"""A transport with a second one behind it: a failed update is delivered again, whole, by the other.

Why it exists: P2P writes over RDMA into buffers each engine registered; a NIC that flaps, an engine
restarted under the same address or a target whose buffer moved fails the update part way. The engines
then hold the old version (P2P loads only at commit), or, when some targets had committed before the
failure, a mix of versions across engines: never a silent partial update, but a run stopped for what
an ordinary transport can still deliver. `FallbackTransport` catches the failure, re-exports the same
version and sends it through the fallback (broadcast where the engines share a network with the
trainer), so every engine ends at the same version either way; the report says so
(`update_weights_fallback` and `update_weights_fallback_<transport>` = 1, `transport` "p2p->broadcast"),
the driver's progress document carries it and the WeightChannel shows Degraded with the reason
(docs/weights.md, "P2P under membership changes and failures"). The next update tries the primary
again. A failure of the fallback too raises both errors.

The export must be iterable twice: `Export` wraps the trainer's export function so that each iteration
exports again (the first, abandoned one is closed first: on a trainer group its ranks finish their
gathers before the next export starts).

Who calls it: lockstep.weights.factory (p2p), lockstep.trainer.local (Export).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from lockstep.weights import phases
from lockstep.weights.transport import MembershipChanged, TransferReport, WeightTransport

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FALLBACK_METRIC = "update_weights_fallback"
"""1.0 when the update was delivered by the fallback transport (0.0 when the primary delivered it)."""


def fallback_metric(transport: str) -> str:
    """update_weights_fallback_<transport> (dashes as underscores): which transport delivered it."""
    return f"{FALLBACK_METRIC}_{transport.replace('-', '_')}"


class Export:
    """The trainer's export as an iterable that exports again on each iteration."""

    def __init__(self, export: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> None:
        self._export = export
        self._live: Iterator[tuple[str, torch.Tensor]] | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.close()
        self._live = iter(self._export())
        return self._live

    def close(self) -> None:
        """Finish the export in progress, if any (a generator's clean-up completes collective gathers)."""
        live, self._live = self._live, None
        close: Any = getattr(live, "close", None)
        if close is not None:
            close()


class FallbackTransport:
    """WeightTransport: `primary`, and for an update it fails, the transport `make_fallback` builds."""

    def __init__(
        self, primary: WeightTransport, make_fallback: Callable[[list[str]], WeightTransport]
    ) -> None:
        self.primary = primary
        """The transport every update tries first."""
        self.make_fallback = make_fallback
        """Engine URLs -> the fallback transport (built at the first failure, then kept)."""
        self.fallback: WeightTransport | None = None
        self.urls: list[str] = []
        self.name = primary.name
        self.fallbacks = 0
        """Updates the fallback delivered so far."""

    def follow(self, urls: list[str]) -> None:
        self.urls = sorted(urls)
        self.primary.follow(urls)
        if self.fallback is not None:
            self.fallback.follow(urls)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> TransferReport:
        with phases.measure() as timer:
            try:
                report = self.primary.update_weights(named_tensors, version)
                report.extra[FALLBACK_METRIC] = 0.0
            except MembershipChanged:
                raise
            except Exception as first:
                report = self._again(named_tensors, version, first)
        return timer.stamp(report)

    def _again(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, first: Exception
    ) -> TransferReport:
        if not isinstance(named_tensors, Export):
            raise first  # a one-shot iterator cannot be sent twice
        named_tensors.close()
        if self.fallback is None:
            self.fallback = self.make_fallback(self.urls)
        fallback = self.fallback
        log.warning(
            "%s update to version %d failed (%s: %s); sending the same version over %s",
            self.primary.name, version, type(first).__name__, first, fallback.name,
        )  # fmt: skip
        try:
            with phases.phase("membership"):
                fallback.follow(self.urls)
            report = fallback.update_weights(named_tensors, version)
        except Exception as second:
            raise RuntimeError(
                f"weight update to version {version}: {self.primary.name} failed ({type(first).__name__}: {first}) "
                f"and the fallback {fallback.name} failed too ({type(second).__name__}: {second})"
            ) from second
        self.fallbacks += 1
        report.transport = f"{self.primary.name}->{fallback.name}"
        report.extra[FALLBACK_METRIC] = 1.0
        report.extra[fallback_metric(fallback.name)] = 1.0
        return report

    def close(self) -> None:
        self.primary.close()
        if self.fallback is not None:
            self.fallback.close()
