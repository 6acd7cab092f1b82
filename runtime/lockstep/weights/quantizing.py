"""QuantizingTransport: every weight push leaves the trainer quantized by the shared quantizer.

Why it exists: BF16 training with low-precision serving (§6, the GLM-5.2 recipe) needs the
online export (stage 3) to quantize exactly as the serving checkpoint was converted (stage 1), with
the same BF16 exceptions. Wrapping the transport keeps every transport unaware of formats: the inner
transport moves the (name, tensor) pairs of SGLang's checkpoint layout (`weight` in FP8/FP4 plus its
scales), and the engine dequantizes exactly what it received (lockstep.numerics.recipe.receive).

Who calls it: lockstep.weights.factory (when spec.rollout.precision is not bf16).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from lockstep.numerics.recipe import Recipe
from lockstep.weights import phases
from lockstep.weights.fallback import Export
from lockstep.weights.transport import TransferReport, WeightTransport

if TYPE_CHECKING:
    import torch


class QuantizingTransport:
    """A WeightTransport that quantizes each push with `recipe` before `inner` moves it."""

    def __init__(self, inner: WeightTransport, recipe: Recipe) -> None:
        self.inner = inner
        """The transport that moves the quantized pairs."""
        self.recipe = recipe
        """The serving format and its BF16 exceptions."""
        self.name = inner.name

    def follow(self, urls: list[str]) -> None:
        self.inner.follow(urls)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> TransferReport:
        counters: list[_Counter] = []

        def quantized() -> Iterator[tuple[str, torch.Tensor]]:
            counters.append(_Counter(phases.timed(named_tensors, "gather"), self.recipe))
            return phases.timed(self.recipe.export(counters[-1]), "quantize")

        # An export the inner transport may send again (a fallback) stays one: each pass quantizes anew.
        named = Export(quantized) if isinstance(named_tensors, Export) else quantized()
        with phases.measure() as timer:
            report = self.inner.update_weights(named, version)
        counted = counters[-1]
        report.extra["update_weights_quantized_tensors"] = float(counted.quantized)
        report.extra["update_weights_bf16_exceptions"] = float(counted.exceptions)
        return timer.stamp(report)

    def served(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """What the engines hold after an update of `named_tensors` (for the pre-flight's checksums)."""
        return self.recipe.served(named_tensors)

    def close(self) -> None:
        self.inner.close()


class _Counter:
    """Passes (name, tensor) pairs through, counting quantized tensors and BF16 exceptions."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], recipe: Recipe) -> None:
        self._named = named
        self._recipe = recipe
        self.quantized = 0
        self.exceptions = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._named:
            d = self._recipe.decide(name, tuple(t.shape))
            self.quantized += d.quantize
            self.exceptions += not d.quantize and d.reason != "not a linear weight"
            yield name, t
