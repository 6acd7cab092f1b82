"""Fixtures of the weight-transfer tests: a real reference engine served over HTTP on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from weights_engine import EngineServer


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lockstep.models.tiny import materialize_builtin

    return materialize_builtin("tiny", tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def engine_server(tiny_dir: Path) -> Iterator[EngineServer]:
    server = EngineServer(tiny_dir, allow_tensor_updates=True)
    yield server
    server.close()
