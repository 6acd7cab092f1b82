"""A driver in a cluster waits for any engine of the pool's headless Service, not for the router.

Found on the real node: the router Service lists only engines at the job's current weight version
(their readiness gate). A driver restarted after its engine was replaced waited for the router, while
the new engine could only become current through that driver's first update: a deadlock, the driver
restarting every 300 s. Here a real reference engine serves on 127.0.0.1 and the headless Service is
`localhost`; the router URL answers nothing (a Service without Ready endpoints).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from lockstep.driver.engines import EngineServer, start_reference_engine, wait_for_engines
from lockstep.serving.client import EngineClient, EngineUnreachable
from lockstep.serving.loop import LoopThread


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    from lockstep.models.tiny import materialize_builtin

    server = start_reference_engine(Path(materialize_builtin("tiny", tmp_path_factory.mktemp("tiny"))))
    yield server
    server.stop()


def test_a_cluster_driver_starts_on_a_serving_engine_of_the_service(
    engine: EngineServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = int(engine.url.rsplit(":", 1)[1])
    monkeypatch.setattr("lockstep.driver.engines.ENGINE_PORT", port)
    monkeypatch.setenv("LOCKSTEP_ENGINES_SERVICE", "localhost")
    runner = LoopThread()
    router = EngineClient(f"http://127.0.0.1:{_free_port()}", retries=1)  # no Ready engine behind it
    try:
        wait_for_engines(runner, [router], 30, cluster=True)  # returns: the engine serves
        with pytest.raises(EngineUnreachable):  # outside a cluster the router itself must answer
            wait_for_engines(runner, [router], 1, cluster=False)
    finally:
        runner.run(router.aclose())
        runner.close()
