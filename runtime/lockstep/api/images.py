"""Lockstep's published image references, versioned with the package.

Why it exists: the operator's default images (OperatorSettings.runtime_image and engine_image), the
images `make images` builds (e2e/controlplane/node/runtime_image.py) and the Dockerfiles' documented
tags must name the same thing, and an upgrade of the package must move all of them. So the reference
is computed from the package version (lockstep.__version__, which pyproject.toml also reads) in this
one place. images/README.md lists the images and what runs in each.

Who calls it: lockstep_operator.settings, the image build, tests.
"""

from __future__ import annotations

from typing import Final

import lockstep

REGISTRY: Final = "ghcr.io/lockstep"
"""Where the release images are published (the operator's defaults point here)."""

IMAGES: Final = ("operator", "runtime", "engine", "trainer-sglang")
"""images/<name>.Dockerfile for each; `make images` builds operator and runtime here."""


def version() -> str:
    """The package version, the tag of every image of this release."""
    return lockstep.__version__


def image_ref(name: str) -> str:
    """`ghcr.io/lockstep/lockstep-<name>:<version>` for one of IMAGES."""
    if name not in IMAGES:
        raise ValueError(f"unknown image {name!r}: one of {', '.join(IMAGES)}")
    return f"{REGISTRY}/lockstep-{name}:{version()}"
