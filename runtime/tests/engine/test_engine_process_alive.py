"""Hostile inputs that used to kill or hang the whole engine process, against `lockstep engine`.

The engine runs as a real subprocess (`lockstep engine`, gloo on loopback, a weight root):

- a weight-update sender that announced 64 floats over HTTP and then broadcast 65 used to trip gloo's
  size check, which aborts the engine process (SIGABRT). With the size preamble
  (lockstep.serving.weight_group) the engine compares the sender's byte counts with the announcement
  before posting any data collective: the update is refused with a 400 naming both, the process stays
  alive, the weights' checksum is unchanged, concurrent generation is unaffected, and the group can be
  joined again for a correct update;
- /update_weights_from_disk on a FIFO used to block in safetensors' reader while it held the GIL, so
  `/health` and `/generate` hung with it; a path outside the engine's weight root was read too. Both
  are refused now (lockstep.engine.disk_reads) while generation goes on.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from lockstep.serving.weight_group import open_weight_update_group, size_preamble
from subprocesses import until

pytestmark = pytest.mark.heavy

KEY = "sizes-key"


@dataclass
class Engine:
    url: str
    proc: subprocess.Popen[bytes]
    root: Path
    """The engine's --weights-root."""
    log: Path

    def alive(self) -> None:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]


AUTH = {"Authorization": f"Bearer {KEY}"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    port = _port()
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    cmd = [sys.executable, "-m", "lockstep", "engine", "--model", "builtin:tiny", "--port", str(port)]
    root = tmp_path_factory.mktemp("weights")
    cmd += ["--api-key", KEY, "--weight-group-timeout", "30", "--weights-root", str(root)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        until("the engine", lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, proc, log)
        yield Engine(url, proc, root, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _checksum(url: str) -> str:
    r = httpx.post(f"{url}/weights_checker", json={"action": "checksum"}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    digest: str = r.json()["per_engine_checksum"]
    return digest


class _Sender:
    """Rank 0 of a gloo group: joins with the engine, then broadcasts what it is told."""

    def __init__(self, url: str, *, announce_sizes: bool) -> None:
        self.url, self.port = url, _port()
        self.group: Any = None
        joined = threading.Thread(target=self._host, args=(announce_sizes,), daemon=True)
        joined.start()
        body = {"master_address": "127.0.0.1", "master_port": self.port, "rank_offset": 1, "world_size": 2}
        r = httpx.post(
            f"{url}/init_weights_update_group", json={**body, "backend": "gloo"}, headers=AUTH, timeout=60
        )
        assert r.json()["success"], r.text
        joined.join(60)
        assert self.group is not None

    def _host(self, announce_sizes: bool) -> None:
        self.group = open_weight_update_group(
            backend="gloo", master_address="127.0.0.1", master_port=self.port, rank=0, world_size=2,
            timeout_s=10, announce_sizes=announce_sizes,
        )  # fmt: skip

    def send(self, preamble: list[int] | None, tensors: list[torch.Tensor]) -> threading.Thread:
        def run() -> None:
            try:
                if preamble is not None:
                    self.group.broadcast(torch.tensor(preamble, dtype=torch.int64), src=0)
                for t in tensors:
                    self.group.broadcast(t, src=0)
            except RuntimeError:
                pass  # the engine refused and closed the group: these collectives have no receiver

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def _norm(url: str) -> tuple[str, list[int]]:
    """A 1-D weight of the tiny model: the first layer's input norm, [hidden=64]."""
    r = httpx.post(f"{url}/weights_checker", json={"action": "checksum"}, headers=AUTH, timeout=60)
    name = next(n for n in sorted(r.json()["ranks"][0]["checksums"]) if n.endswith("input_layernorm.weight"))
    return name, [64]


def test_a_sender_whose_collectives_exceed_its_announcement_is_refused_and_the_engine_lives(
    engine: Engine,
) -> None:
    url, proc = engine.url, engine.proc
    before = _checksum(url)
    name, shape = _norm(url)
    n = shape[0]
    announce = {"names": [name], "dtypes": ["float32"], "shapes": [shape], "weight_version": "1"}
    sender = _Sender(url, announce_sizes=True)
    generating = {"input_ids": [2, 20, 21], "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
        results: list[httpx.Response] = []
        valid = threading.Thread(target=lambda: results.append(http.post("/generate", json=generating)))
        valid.start()
        # 65 floats sent where 64 were announced: the preamble says so, computed from what is sent
        sent = sender.send(size_preamble([name], ["float32"], [[n + 1]]), [torch.ones(n + 1)])
        reply = http.post("/update_weights_from_distributed", json=announce)
        sent.join(30)
        valid.join(120)
    assert reply.status_code == 400, reply.text
    message = reply.json()["message"]
    assert f"{4 * (n + 1)} bytes" in message and f"{4 * n} bytes" in message and "unchanged" in message, (
        message
    )
    engine.alive()
    assert results and results[0].status_code == 200, results
    assert results[0].json()["meta_info"]["completion_tokens"] == 64
    assert _checksum(url) == before
    assert httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"] == "0"
    # the refused group is closed: a new one takes a correct update
    again = _Sender(url, announce_sizes=True)
    new = torch.full((n,), 0.5)
    sent = again.send(size_preamble([name], ["float32"], [shape]), [new])
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
        ok = http.post("/update_weights_from_distributed", json=announce)
    sent.join(30)
    assert ok.status_code == 200 and ok.json()["success"], ok.text
    assert _checksum(url) != before and proc.poll() is None
    assert httpx.post(f"{url}/destroy_weights_update_group", json={}, headers=AUTH).json()["success"]


def test_a_sender_without_the_preamble_still_updates(
    engine: Engine,
) -> None:
    """A group whose sender does not advertise the preamble (stock SGLang's protocol) works as before."""
    url, proc = engine.url, engine.proc
    before = _checksum(url)
    name, shape = _norm(url)
    sender = _Sender(url, announce_sizes=False)
    sent = sender.send(None, [torch.full(shape, 0.25)])
    announce = {"names": [name], "dtypes": ["float32"], "shapes": [shape], "weight_version": "1"}
    ok = httpx.post(f"{url}/update_weights_from_distributed", json=announce, headers=AUTH, timeout=120)
    sent.join(30)
    assert ok.status_code == 200 and ok.json()["success"], ok.text
    assert _checksum(url) != before and proc.poll() is None
    assert httpx.post(f"{url}/destroy_weights_update_group", json={}, headers=AUTH).json()["success"]


# -- disk updates -------------------------------------------------------------------------------------


def _generate_while(engine: Engine, fn: Any) -> tuple[httpx.Response, list[httpx.Response], list[int]]:
    """fn() (a disk update) while a 64-token generation runs and /health is polled; returns fn's reply,
    the generation's reply and the /health statuses seen while fn ran."""
    body = {"input_ids": [2, 20, 21], "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    results: list[httpx.Response] = []
    gen = threading.Thread(
        target=lambda: results.append(
            httpx.post(f"{engine.url}/generate", json=body, headers=AUTH, timeout=120)
        )
    )
    gen.start()
    health: list[int] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            health.append(httpx.get(f"{engine.url}/health", timeout=30).status_code)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        reply = fn()
    finally:
        done.set()
        poller.join(60)
        gen.join(120)
    return reply, results, health


def _disk_update(engine: Engine, path: Path | str) -> httpx.Response:
    body = {"model_path": str(path), "weight_version": "9"}
    return httpx.post(f"{engine.url}/update_weights_from_disk", json=body, headers=AUTH, timeout=60)


def test_a_fifo_in_place_of_the_weights_is_refused_and_health_answers(engine: Engine) -> None:
    before = _checksum(engine.url)
    ckpt = engine.root / "fifo-ckpt"
    ckpt.mkdir()
    os.mkfifo(ckpt / "model.safetensors")  # nobody ever writes: a read would block forever
    reply, gen, health = _generate_while(engine, lambda: _disk_update(engine, ckpt))
    assert reply.status_code == 400 and "not a regular file" in reply.json()["message"], reply.text
    assert gen and gen[0].status_code == 200 and gen[0].json()["meta_info"]["completion_tokens"] == 64
    assert health and set(health) == {200}
    engine.alive()
    assert _checksum(engine.url) == before


def test_a_path_outside_the_weight_root_is_refused(engine: Engine, tiny_dir_b: Path, tmp_path: Path) -> None:
    before = _checksum(engine.url)
    outside = _disk_update(engine, tiny_dir_b)
    assert outside.status_code == 400 and "outside the engine's weight roots" in outside.json()["message"]
    link = engine.root / "link-out"
    link.symlink_to(tiny_dir_b)  # inside by name, outside once resolved
    assert "outside the engine's weight roots" in _disk_update(engine, link).json()["message"]
    sneaky = engine.root / "sneaky"
    sneaky.mkdir()
    (sneaky / "model.safetensors").symlink_to(tiny_dir_b / "model.safetensors")
    assert "outside the weight root" in _disk_update(engine, sneaky).json()["message"]
    assert _checksum(engine.url) == before
    inside = engine.root / "good"
    inside.mkdir()
    (inside / "model.safetensors").write_bytes((tiny_dir_b / "model.safetensors").read_bytes())
    ok = _disk_update(engine, inside)
    assert ok.status_code == 200 and ok.json()["success"], ok.text
    assert _checksum(engine.url) != before
    engine.alive()
