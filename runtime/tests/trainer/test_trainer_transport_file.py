"""spec.weightSync.transport `auto` is resolved from the operator's transport file on the trainer ranks.

The WeightChannel's choice reaches the ranks as transport.json next to job.yaml (the job's config
ConfigMap mounted at /etc/lockstep). Covers the rule (explicit wins; auto + file -> the file's
transport; auto without a file -> the one-machine rule outside a pod, a wait then a clear error in a
pod, with an injected clock), a bad file is an error naming it, and `lockstep trainer --serve` with a
transport.json of `broadcast` pushes to a real reference engine on 127.0.0.1 by broadcast (the push
reports the broadcast's wire bytes and the engine holds the new version).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from lockstep.api import RLJob, TransportChoice, TransportFileError, load_manifest, load_transport_choice
from lockstep.config.trainer import transport_config, with_transport
from lockstep.weights.factory import (
    LOCAL_RULE,
    TransportNotChosen,
    TransportResolution,
    resolve_transport,
    wait_for_transport,
)

FIXTURE = Path(__file__).parents[1] / "driver" / "fixtures" / "tiny-fast.yaml"
CHOICE = TransportChoice(transport="broadcast", reason="one network without RDMA", observed_generation=1)


def _job(transport: str = "auto") -> RLJob:
    raw = yaml.safe_load(FIXTURE.read_text())
    raw["spec"]["weightSync"] = {"transport": transport}
    return RLJob.model_validate(raw)


@pytest.mark.parametrize(
    ("requested", "choice", "in_pod", "expected"),
    [
        ("p2p", CHOICE, True, TransportResolution("p2p", "spec", "spec.weightSync.transport is p2p")),
        ("disk-delta", None, True, TransportResolution("disk-delta", "spec", "spec.weightSync.transport is disk-delta")),
        ("auto", CHOICE, True, TransportResolution("broadcast", "operator", "one network without RDMA")),
        ("auto", CHOICE, False, TransportResolution("broadcast", "operator", "one network without RDMA")),
        ("auto", None, False, TransportResolution("auto", "local", LOCAL_RULE)),
        ("auto", None, True, None),
    ],
)  # fmt: skip
def test_resolution_rule(
    requested: str, choice: TransportChoice | None, in_pod: bool, expected: TransportResolution | None
) -> None:
    assert resolve_transport(requested, choice, in_pod=in_pod) == expected


class FakeClock:
    """An injected clock: `sleep` advances it and runs `at` once it reaches a time."""

    def __init__(self, at: float | None = None, action: object = None) -> None:
        self.now = 0.0
        self.at, self.action = at, action
        self.sleeps = 0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.sleeps += 1
        if self.at is not None and self.now >= self.at and callable(self.action):
            self.action()
            self.at = None


def test_in_a_pod_it_waits_for_the_file(tmp_path: Path) -> None:
    path = tmp_path / "transport.json"
    fake = FakeClock(at=5.0, action=lambda: path.write_text(CHOICE.to_json()))
    found = wait_for_transport(
        transport_config(_job()), path, in_pod=True, timeout_s=60, clock=fake.clock, sleep=fake.sleep
    )
    assert found == TransportResolution("broadcast", "operator", "one network without RDMA")
    assert fake.now == 5.0  # it waited for the operator, no longer


def test_in_a_pod_no_file_is_a_clear_error_after_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "transport.json"
    fake = FakeClock()
    with pytest.raises(TransportNotChosen) as err:
        wait_for_transport(
            transport_config(_job()), path, in_pod=True, timeout_s=30, clock=fake.clock, sleep=fake.sleep
        )
    assert str(path) in str(err.value) and "tiny-fast-weights" in str(err.value) and "30 s" in str(err.value)
    assert fake.now == 30.0


def test_outside_a_pod_and_explicit_never_wait(tmp_path: Path) -> None:
    fake = FakeClock()
    missing = tmp_path / "transport.json"
    local = wait_for_transport(
        transport_config(_job()), missing, in_pod=False, timeout_s=60, clock=fake.clock, sleep=fake.sleep
    )
    assert local.source == "local" and local.transport == "auto"
    missing.write_text("not json")  # an explicit transport never reads the file
    spec = wait_for_transport(
        transport_config(_job("p2p")), missing, in_pod=True, timeout_s=60, clock=fake.clock, sleep=fake.sleep
    )
    assert spec.transport == "p2p" and fake.sleeps == 0


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"transport": "auto", "reason": "x"}', "transport"),
        ('{"transport": "broadcast"}', "reason"),
        ('{"transport": "broadcast", "reason": "x", "extra": 1}', "extra"),
        ("not json", "(document)"),
    ],
)
def test_a_bad_file_names_the_file_and_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "transport.json"
    path.write_text(text)
    with pytest.raises(TransportFileError) as err:
        load_transport_choice(path)
    assert str(err.value).startswith(f"{path}: {field}")
    with pytest.raises(TransportFileError):
        wait_for_transport(transport_config(_job()), path, in_pod=True, timeout_s=5)


def test_with_transport_is_validated_like_the_manifest() -> None:
    job = with_transport(_job(), "broadcast")
    assert str(job.spec.weight_sync.transport) == "broadcast" and job.metadata.name == "tiny-fast"
    with pytest.raises(ValueError, match="transport"):
        with_transport(_job(), "carrier-pigeon")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    from lockstep.driver.engines import start_reference_engine
    from lockstep.models import resolve_checkpoint

    cache = tmp_path_factory.mktemp("cache")
    server = start_reference_engine(resolve_checkpoint("builtin:tiny", cache_dir=cache))
    try:
        yield server.url, cache
    finally:
        server.stop()


def test_trainer_serve_updates_weights_by_the_operators_transport(
    engine: tuple[str, Path], tmp_path: Path
) -> None:
    url, cache = engine
    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text(FIXTURE.read_text())  # transport: auto (the default)
    assert str(load_manifest(job_yaml).spec.weight_sync.transport) == "auto"
    (tmp_path / "transport.json").write_text(CHOICE.to_json())
    port, log = _free_port(), tmp_path / "trainer.log"
    cmd = [
        sys.executable, "-m", "lockstep", "trainer", "--config", str(job_yaml), "--serve",
        "--host", "127.0.0.1", "--port", str(port), "--out", str(tmp_path / "out"),
        "--cache-dir", str(cache), "--engine-url", url,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCKSTEP_ROLE": "trainer"}
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/v2"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).json()["ready"]:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        first = httpx.post(f"{base}/first_update", json={"version": 0}, timeout=120)
        assert first.status_code == 200, first.text
        updated = httpx.post(f"{base}/update_weights", json={"version": 1}, timeout=120)
        assert updated.status_code == 200, updated.text
        metrics = updated.json()["metrics"]
        # Only the broadcast transport reports wire bytes (from-disk, the local rule, reports none).
        assert metrics["update_weights_wire_bytes"] > 0 and metrics["update_weights_engines"] == 1.0, metrics
        assert str(httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"]) == "1"
        assert httpx.post(f"{base}/shutdown", json={}, timeout=30).status_code == 200
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "weight transport broadcast, chosen by the operator: one network without RDMA" in text, text[
        -3000:
    ]
