"""Shared pytest set-up for the runtime tests: GPU tests are skipped where CUDA is absent."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing: an operator-only install
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu); run on the device machine")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
