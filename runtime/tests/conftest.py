"""Shared pytest set-up for the runtime tests: GPU tests are skipped where CUDA is absent; the tests
listed in heavy.txt are marked `heavy` (`make check` leaves them out); HF-layout fixture checkpoints
per family (hf_checkpoints.py) are built once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

HEAVY = frozenset(
    line.strip()
    for line in (Path(__file__).parent / "heavy.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)
"""Node IDs and test files marked heavy (heavy.txt says which and why)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in HEAVY or item.nodeid.split("::")[0] in HEAVY:
            item.add_marker(pytest.mark.heavy)
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


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Build (once per session) the HF-layout fixture checkpoint of a family: qwen3, qwen3-moe, glm5."""
    from hf_checkpoints import write_checkpoint  # runtime/tests is on sys.path (this conftest's dir)

    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = write_checkpoint(name, tmp_path_factory.mktemp("hf") / name)
        return built[name]

    return get
