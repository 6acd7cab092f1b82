"""Fixtures of the engine tests: tiny checkpoints on disk (two seeds: before and after an update)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lockstep.models.tiny import materialize_builtin


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = materialize_builtin("builtin:tiny", tmp_path_factory.mktemp("tiny0"), seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_dir_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Different weights (another seed): what a weight update switches to."""
    path: Path = materialize_builtin("builtin:tiny", tmp_path_factory.mktemp("tiny1"), seed=1)
    return path
