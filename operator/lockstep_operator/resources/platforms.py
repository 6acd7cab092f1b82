"""What the operator knows about the cluster's nodes: GPU product labels and image architectures (pure).

Why it exists: two facts about nodes are the cluster's, not the job's. The value GPU feature discovery
writes into nvidia.com/gpu.product for a product (NVIDIA-GB300, NVIDIA-H100-80GB-HBM3; another
vendor's discovery, or a renamed SKU, writes another), and which CPU architectures an image exists
for: GB300 trays are Grace (arm64) and a pod whose image has no arm64 variant would be placed there
and fail with `exec format error`. Both come from the operator settings
(LOCKSTEP_OPERATOR_GPU_PRODUCTS, LOCKSTEP_OPERATOR_IMAGE_ARCHITECTURES,
LOCKSTEP_OPERATOR_DEFAULT_IMAGE_ARCHITECTURES); every pod gets a required node affinity on
kubernetes.io/arch with the architectures all of its images (main and init containers) have, so the
scheduler never places an image on a node whose architecture it lacks.

Who calls it: lockstep_operator.settings (builds one), the pod builders (resources.ranks, engines,
driver) and the placement plans (reconcile.rljob, trainergroup).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

ARCH_LABEL = "kubernetes.io/arch"
"""The kubelet's node label of the CPU architecture (GOARCH names: amd64, arm64)."""
ARCHITECTURES = ("amd64", "arm64")
"""Architectures an image may declare (the ones Lockstep's images are built for)."""
LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")

DEFAULT_GPU_PRODUCTS = ("GB300=NVIDIA-GB300", "H100=NVIDIA-H100-80GB-HBM3")
"""spec.placement.gpuProduct -> nvidia.com/gpu.product, as NVIDIA's GPU feature discovery writes them."""
DEFAULT_IMAGE_ARCHITECTURES = ("ghcr.io/lockstep/=amd64|arm64",)
"""Lockstep's release images are multi-architecture indexes (`make images`, images/README.md)."""
DEFAULT_ARCHITECTURES = ("amd64",)
"""An image named by no rule: assumed amd64 only, the one architecture nearly every image has (a
multi-architecture image is declared in LOCKSTEP_OPERATOR_IMAGE_ARCHITECTURES)."""


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """GPU product labels and image architectures, parsed and checked (see the module docstring)."""

    products: Mapping[str, str] = field(default_factory=dict)
    """GPUProduct value (GB300, H100) -> nvidia.com/gpu.product label value."""
    image_rules: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(image reference prefix, architectures); the longest matching prefix wins."""
    default_architectures: tuple[str, ...] = DEFAULT_ARCHITECTURES
    """Architectures of an image no rule names."""

    def product_label(self, product: str) -> str | None:
        """The nvidia.com/gpu.product value for a GPUProduct; None for `any`."""
        return self.products.get(product)

    def image_architectures(self, image: str) -> tuple[str, ...]:
        """The architectures `image` exists for."""
        best: tuple[str, tuple[str, ...]] | None = None
        for prefix, arches in self.image_rules:
            if image.startswith(prefix) and (best is None or len(prefix) > len(best[0])):
                best = (prefix, arches)
        return best[1] if best is not None else self.default_architectures

    def pod_architectures(self, images: Iterable[str]) -> tuple[str, ...]:
        """The architectures every one of a pod's images exists for (sorted). Empty means no node
        can run the pod: the pod builders refuse it (ImageArchitectureError)."""
        images = list(images)
        common = set(ARCHITECTURES)
        for image in images:
            common &= set(self.image_architectures(image))
        return tuple(sorted(common))


class ImageArchitectureError(ValueError):
    """A pod's images share no architecture; the message names the images and the setting."""


def parse_products(entries: Iterable[str], allowed: Iterable[str]) -> dict[str, str]:
    """`PRODUCT=LABEL` entries -> a dict; raises ValueError naming the bad entry and the fix."""
    allowed = tuple(allowed)
    out: dict[str, str] = {}
    for entry in entries:
        key, sep, value = entry.partition("=")
        if not sep or key not in allowed:
            raise ValueError(
                f"{entry!r}: each entry is PRODUCT=LABEL with PRODUCT one of {', '.join(allowed)} "
                "(spec.placement.gpuProduct), e.g. GB300=NVIDIA-GB300"
            )
        if not LABEL_VALUE.match(value):
            raise ValueError(
                f"{entry!r}: {value!r} is not a Kubernetes label value (63 characters, [-A-Za-z0-9_.])"
            )
        out[key] = value
    return out


def parse_architectures(arches: Iterable[str], where: str) -> tuple[str, ...]:
    out = tuple(a.strip() for a in arches if a.strip())
    bad = [a for a in out if a not in ARCHITECTURES]
    if not out or bad:
        raise ValueError(
            f"{where}: architectures must be some of {', '.join(ARCHITECTURES)}, got {list(out)}"
        )
    return tuple(sorted(set(out)))


def parse_image_rules(entries: Iterable[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`PREFIX=ARCH|ARCH` entries -> rules; raises ValueError naming the bad entry and the fix."""
    rules = []
    for entry in entries:
        prefix, sep, arches = entry.rpartition("=")
        if not sep or not prefix:
            raise ValueError(
                f"{entry!r}: each entry is IMAGE_PREFIX=ARCH|ARCH, e.g. ghcr.io/lockstep/=amd64|arm64"
            )
        rules.append((prefix, parse_architectures(arches.split("|"), repr(entry))))
    return tuple(rules)


def default_facts() -> NodeFacts:
    """The facts of the default operator settings."""
    return NodeFacts(
        products=parse_products(DEFAULT_GPU_PRODUCTS, ("GB300", "H100")),
        image_rules=parse_image_rules(DEFAULT_IMAGE_ARCHITECTURES),
        default_architectures=DEFAULT_ARCHITECTURES,
    )
