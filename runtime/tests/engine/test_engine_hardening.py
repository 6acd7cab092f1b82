"""The reference engine under hostile and faulty input, through its real HTTP server on 127.0.0.1.

Every failed weight update of every kind leaves the engine byte-identical (sha256 of every weight
before and after) at the same version, and says so; hostile requests get the status the table
names, while the engine goes on serving others; without the job's key every mutating route is 401;
a weight-group join is bounded and visible in /health; the tensor path never dials an address a
payload names.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import pickle
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.engine.server import OPEN_READS
from lockstep.models.tiny import chat_tokenizer
from lockstep.serving import EngineClient, SamplingParams, dumps_named_tensors
from lockstep.serving.weight_group import open_weight_update_group
from safetensors.torch import load_file, save_file

TOK = chat_tokenizer()
KEY = "k3y-for-tests"


@dataclass
class Served:
    engine: ReferenceEngine
    url: str
    http: httpx.AsyncClient
    app: Any


@dataclass
class _Serve:
    path: Path
    app_kw: dict[str, Any]
    engine_kw: dict[str, Any]


async def _serve(
    path: Path, *, engine_kw: dict[str, Any] | None = None, **app_kw: Any
) -> AsyncIterator[Served]:
    engine = ReferenceEngine.load(
        path, max_running_requests=4, context_length=256, seed=0, **(engine_kw or {})
    )
    app = create_app(engine, **app_kw)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    headers = {"Authorization": f"Bearer {app_kw['api_key']}"} if app_kw.get("api_key") else {}
    http = httpx.AsyncClient(base_url=url, timeout=120, headers=headers)
    try:
        yield Served(engine, url, http, app)
    finally:
        await http.aclose()
        await server.close()


@pytest.fixture
async def served(tiny_dir: Path) -> AsyncIterator[Served]:
    async for s in _serve(tiny_dir, allow_tensor_updates=True, weight_group_timeout_s=3.0):
        yield s


def _digest(engine: ReferenceEngine) -> dict[str, str]:
    """sha256 of every weight's bytes, by name."""
    return {
        n: hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in engine.named_weights().items()
    }


def _prompt(text: str = "hello") -> list[int]:
    ids: list[int] = TOK.render([{"role": "user", "content": text}], add_generation_prompt=True)
    return ids


async def _generate(served: Served, max_new: int = 4, **sp: Any) -> httpx.Response:
    body = {
        "input_ids": _prompt(),
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True, **sp},
    }
    return await served.http.post("/generate", json=body)


async def _assert_serves(served: Served) -> None:
    r = await _generate(served)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["finish_reason"]["type"] == "length"


def _refused(reply: httpx.Response, version: int) -> None:
    assert reply.status_code == 400, reply.text
    body = reply.json()
    assert body["success"] is False and "unchanged" in body["message"], body
    assert body["weight_version"] == str(version)


# -- failed loads leave the engine byte-identical ----------------------------------------------


def _bad_checkpoint(kind: str, good: Path, out: Path) -> Path:
    new = load_file(str(good / "model.safetensors"))
    name = sorted(new)[0]
    out.mkdir()
    if kind == "unknown name":  # one valid tensor, one unknown: the valid one must not land
        save_file(
            {name: new[name], "model.layers.99.mlp.up_proj.weight": torch.ones(2, 2)}, out / "a.safetensors"
        )
    elif kind == "shape":
        save_file({**new, name: torch.ones(3)}, out / "model.safetensors")
    elif kind == "corrupt file":
        save_file(new, out / "model.safetensors")
        data = (out / "model.safetensors").read_bytes()
        (out / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated mid-tensor
    elif kind == "second file corrupt":
        save_file({name: new[name]}, out / "a.safetensors")
        (out / "b.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad}xxx")
    elif kind == "missing":
        out.rmdir()
    return out


@pytest.mark.parametrize("kind", ["unknown name", "shape", "corrupt file", "second file corrupt", "missing"])
async def test_failed_disk_load_leaves_the_engine_byte_identical(
    served: Served, tiny_dir_b: Path, tmp_path: Path, kind: str
) -> None:
    path = _bad_checkpoint(kind, tiny_dir_b, tmp_path / "ckpt")
    await _assert_serves(served)  # fills the prefix cache
    before = _digest(served.engine)
    reply = await served.http.post(
        "/update_weights_from_disk", json={"model_path": str(path), "weight_version": "7"}
    )
    _refused(reply, 0)
    assert _digest(served.engine) == before and served.engine.weight_version == 0
    r = await _generate(served)
    assert r.json()["meta_info"]["cached_tokens"] > 0  # a refused update flushes nothing


async def test_older_versions_label_only_new_weights(
    served: Served, tiny_dir: Path, tiny_dir_b: Path
) -> None:
    """Relabeling the served weights with an older version is refused; an older version that comes
    with its weights (a driver resumed from an earlier checkpoint, or from the base policy) re-syncs."""
    ok = await served.http.post(
        "/update_weights_from_disk", json={"model_path": str(tiny_dir_b), "weight_version": "3"}
    )
    assert ok.status_code == 200 and ok.json()["success"], ok.text
    before = _digest(served.engine)
    low = await served.http.post("/update_weight_version", json={"new_version": "2"})
    assert low.status_code == 400 and "only move forward" in low.json()["message"]
    assert _digest(served.engine) == before and served.engine.weight_version == 3
    again = await served.http.post(
        "/update_weights_from_disk", json={"model_path": str(tiny_dir), "weight_version": "1"}
    )
    assert again.status_code == 200 and again.json()["success"], again.text
    assert served.engine.weight_version == 1 and _digest(served.engine) != before


async def test_failed_tensor_load_leaves_the_engine_byte_identical(served: Served, tiny_dir_b: Path) -> None:
    new = load_file(str(tiny_dir_b / "model.safetensors"))
    name = sorted(new)[0]
    payload = dumps_named_tensors([(name, new[name]), ("model.layers.99.mlp.up_proj.weight", torch.ones(2))])
    before = _digest(served.engine)
    reply = await served.http.post(
        "/update_weights_from_tensor", json={"serialized_named_tensors": [payload], "weight_version": "4"}
    )
    _refused(reply, 0)
    assert _digest(served.engine) == before and served.engine.weight_version == 0


class _DyingSender:
    """Rank 0 of a gloo group that broadcasts only the first of the tensors it announced, then dies."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.first: torch.Tensor | None = None
        self.go = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        group = open_weight_update_group(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=self.port,
            rank=0,
            world_size=2,
            timeout_s=20,
        )
        self.go.wait(60)
        assert self.first is not None
        group.broadcast(self.first, src=0)
        group.close()  # the sender is gone before the second broadcast
        del group


async def test_distributed_update_whose_sender_dies_leaves_the_engine_byte_identical(
    served: Served, tiny_dir_b: Path
) -> None:
    new = load_file(str(tiny_dir_b / "model.safetensors"))
    names = sorted(new)[:2]
    sender = _DyingSender()
    join = await served.http.post(
        "/init_weights_update_group",
        json={
            "master_address": "127.0.0.1",
            "master_port": sender.port,
            "rank_offset": 1,
            "world_size": 2,
            "backend": "gloo",
        },
    )
    assert join.json()["success"], join.text
    before = _digest(served.engine)
    sender.first = new[names[0]].contiguous()
    sender.go.set()
    reply = await served.http.post(
        "/update_weights_from_distributed",
        json={
            "names": names,
            "dtypes": [str(new[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(new[n].shape) for n in names],
            "weight_version": "5",
        },
    )
    _refused(reply, 0)
    # The first tensor arrived whole, yet it reached no weight: the update is all or nothing.
    assert _digest(served.engine) == before and served.engine.weight_version == 0
    await _assert_serves(served)
    await served.http.post("/destroy_weights_update_group", json={})


@pytest.mark.parametrize("version", ["-5", str(10**30), "abc", "1.5"])
async def test_bad_versions_are_refused(served: Served, version: str) -> None:
    reply = await served.http.post("/update_weight_version", json={"new_version": version})
    assert reply.status_code == 400 and reply.json()["success"] is False
    assert served.engine.weight_version == 0
    assert (await served.http.get("/model_info")).json()["weight_version"] == "0"


async def test_versions_only_move_forward(served: Served) -> None:
    assert (await served.http.post("/update_weight_version", json={"new_version": "4"})).status_code == 200
    assert (await served.http.post("/update_weight_version", json={"new_version": "4"})).status_code == 200
    low = await served.http.post("/update_weight_version", json={"new_version": "3"})
    assert low.status_code == 400 and "only move forward" in low.json()["message"]
    assert served.engine.weight_version == 4


# -- hostile input: the table ------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    return b'{"input_ids": ' + b"[" * depth + b"]" * depth + b"}"


_GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
HOSTILE: list[tuple[str, str, str, Any, int]] = [
    # (row, method, path, body: dict | bytes, status)
    ("top_k 2**70", "POST", "/generate", {**_GEN, "sampling_params": {"top_k": 2**70}}, 400),
    ("top_k 0", "POST", "/generate", {**_GEN, "sampling_params": {"top_k": 0}}, 400),
    ("seed 2**70", "POST", "/generate", {**_GEN, "sampling_params": {"sampling_seed": 2**70}}, 400),
    (
        "temperature NaN",
        "POST",
        "/generate",
        b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}',
        400,
    ),
    (
        "temperature inf",
        "POST",
        "/generate",
        b'{"input_ids": [1], "sampling_params": {"temperature": 1e999}}',
        400,
    ),
    ("top_p 0", "POST", "/generate", {**_GEN, "sampling_params": {"top_p": 0}}, 400),
    (
        "max_new_tokens 2**62",
        "POST",
        "/generate",
        {**_GEN, "sampling_params": {"max_new_tokens": 2**62}},
        400,
    ),
    ("token outside vocab", "POST", "/generate", {"input_ids": [10**9]}, 400),
    ("negative token", "POST", "/generate", {"input_ids": [-1]}, 400),
    ("empty prompt", "POST", "/generate", {"input_ids": []}, 400),
    (
        "too many stop ids",
        "POST",
        "/generate",
        {**_GEN, "sampling_params": {"stop_token_ids": list(range(5000))}},
        400,
    ),
    ("batch beyond the queue", "POST", "/generate", {"input_ids": [[1]] * 2000}, 400),
    ("duplicate rids", "POST", "/generate", {"input_ids": [[1], [2]], "rid": ["a", "a"]}, 400),
    ("nested JSON 100k", "POST", "/generate", _nested(100_000), 400),
    ("not JSON", "POST", "/generate", b"\xff\xfe{", 400),
    ("body 40 MiB", "POST", "/generate", b"[" + b"1," * (20 << 20) + b"1]", 413),
    ("version -5", "POST", "/update_weight_version", {"new_version": "-5"}, 400),
    ("version 10**30", "POST", "/update_weight_version", {"new_version": str(10**30)}, 400),
    ("disk path missing", "POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}, 400),
    ("disk path /dev/zero", "POST", "/update_weights_from_disk", {"model_path": "/dev"}, 400),
    (
        "group port 0",
        "POST",
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": 0,
            "rank_offset": 1,
            "world_size": 2,
            "backend": "gloo",
        },
        400,
    ),
    (
        "group bad backend",
        "POST",
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": 1,
            "rank_offset": 1,
            "world_size": 2,
            "backend": "mpi",
        },
        400,
    ),
    (
        "update without group",
        "POST",
        "/update_weights_from_distributed",
        {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]},
        400,
    ),
    (
        "tensor payload garbage",
        "POST",
        "/update_weights_from_tensor",
        {"serialized_named_tensors": ["AAAA"]},
        400,
    ),
    ("pause bad mode", "POST", "/pause_generation", {"mode": "forever"}, 400),
    ("unknown field", "POST", "/abort_request", {"rid": "x", "evil": 1}, 400),
    ("unknown route", "POST", "/lockstep_nothing_here", {}, 404),
]


async def test_hostile_input_table(served: Served) -> None:
    """Each row: its status; the engine still serves; weights, version and cache state unchanged."""
    before = _digest(served.engine)
    for row, method, path, body, status in HOSTILE:
        kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
        reply = await served.http.request(method, path, **kw)
        assert reply.status_code == status, f"{row}: {reply.status_code} {reply.text[:300]}"
        await _assert_serves(served)
        assert _digest(served.engine) == before, row
        assert served.engine.weight_version == 0, row
        assert not served.engine.is_paused, row
    assert served.engine.stats.failed_steps == 0


async def test_one_bad_request_never_fails_another(served: Served) -> None:
    """A top_k that overflows the sampling kernel used to fail the whole step, aborting its batch."""
    valid = [asyncio.create_task(_generate(served, max_new=24)) for _ in range(3)]
    while served.engine.stats.generated_tokens < 3:
        await asyncio.sleep(0.001)
    bad = await _generate(served, top_k=2**70)
    assert bad.status_code == 400 and "top_k" in bad.text
    for r in await asyncio.gather(*valid):
        assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length", r.text
    assert served.engine.stats.failed_steps == 0


async def test_a_full_queue_answers_503_with_retry_after(tiny_dir: Path) -> None:
    async for s in _serve(tiny_dir, engine_kw={"max_queued_requests": 2}):
        await s.engine.pause("in_place")  # nothing runs: requests stay queued
        queued = [asyncio.create_task(_generate(s)) for _ in range(2)]
        while s.engine.queued < 2:
            await asyncio.sleep(0.001)
        full = await _generate(s)
        assert full.status_code == 503 and full.headers["Retry-After"] == "1", full.text
        await s.engine.resume()
        assert all(r.status_code == 200 for r in await asyncio.gather(*queued))


# -- auth -------------------------------------------------------------------------------------


async def test_every_mutating_route_needs_the_key(tiny_dir: Path) -> None:
    async for s in _serve(tiny_dir, api_key=KEY):
        routes = sorted(
            {(r.method, r.resource.canonical) for r in s.app.router.routes() if r.method != "HEAD"}  # type: ignore[union-attr]
        )
        mutating = [(m, p) for m, p in routes if not (m == "GET" and p in OPEN_READS)]
        assert ("POST", "/update_weight_version") in mutating and ("GET", "/flush_cache") in mutating
        async with httpx.AsyncClient(base_url=s.url) as anon:
            for method, path in mutating:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                    r = await anon.request(method, path, json={}, headers=headers)
                    assert r.status_code == 401, (method, path, headers, r.status_code)
                    assert KEY not in r.text
            for path in sorted(OPEN_READS - {"/health_generate"}):
                assert (await anon.get(path)).status_code == 200, path
        assert s.engine.weight_version == 0
        # The runtime's client sends the key (given, or from LOCKSTEP_API_KEY).
        async with EngineClient(s.url, api_key=KEY) as client:
            res = await client.generate(_prompt(), SamplingParams(max_new_tokens=2))
            assert len(res.output_ids) == 2
            await client.update_weight_version(1)
        assert s.engine.weight_version == 1


async def test_the_client_reads_the_key_from_the_environment(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCKSTEP_API_KEY", KEY)
    async for s in _serve(tiny_dir, api_key=KEY):
        async with EngineClient(s.url) as client:
            await client.update_weight_version(2)
        assert s.engine.weight_version == 2


# -- the weight-group join ------------------------------------------------------------------------


def _dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_JOIN = {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2, "backend": "gloo"}


async def test_a_join_is_bounded_and_not_ready_meanwhile(served: Served) -> None:
    join = asyncio.create_task(
        served.http.post("/init_weights_update_group", json={**_JOIN, "master_port": _dead_port()})
    )
    while (await served.http.get("/health")).status_code == 200:
        await asyncio.sleep(0.01)
    assert (await served.http.get("/health")).status_code == 503
    await _assert_serves(served)  # generation goes on while the join waits
    assert not join.done()
    reply = await join  # bounded by weight_group_timeout_s=3
    assert reply.status_code == 400 and reply.json()["success"] is False
    assert (await served.http.get("/health")).status_code == 200
    assert served.engine.weight_group is None


async def test_destroy_cancels_a_join(served: Served) -> None:
    join = asyncio.create_task(
        served.http.post("/init_weights_update_group", json={**_JOIN, "master_port": _dead_port()})
    )
    while (await served.http.get("/health")).status_code == 200:
        await asyncio.sleep(0.01)
    cancel = await served.http.post("/destroy_weights_update_group", json={})
    assert cancel.json()["success"], cancel.text
    assert (await served.http.get("/health")).status_code == 200
    assert (await join).json()["success"] is False
    assert served.engine.weight_group is None


# -- the tensor path ------------------------------------------------------------------------------


class _Evil:
    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def _payload(obj: Any) -> str:
    import base64

    buf = io.BytesIO()
    pickle.Pickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


async def test_the_tensor_path_never_dials_a_sender_chosen_address(served: Served) -> None:
    """fd passing makes the receiver connect to the sender's resource sharer: a payload pointing it at
    a listener that never answers used to hang the engine. Refused now, as are segment names outside
    torch's shared-memory names."""
    from multiprocessing.resource_sharer import DupFd

    from torch.multiprocessing.reductions import rebuild_storage_fd, rebuild_storage_filename

    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen()  # accepts the connection, never answers
        dup = object.__new__(DupFd)
        dup._id = (trap.getsockname(), 1)  # type: ignore[attr-defined]
        fd_payload = _payload(
            [("model.embed_tokens.weight", _Evil(rebuild_storage_fd, (torch.UntypedStorage, dup, 16)))]
        )
        shm_payload = _payload(
            [
                (
                    "x",
                    _Evil(
                        rebuild_storage_filename,
                        (torch.UntypedStorage, b"/tmp/sock", b"/../../etc/passwd", 16),
                    ),
                )
            ]
        )
        before = _digest(served.engine)
        for payload, needle in (
            (fd_payload, "rebuild_storage_fd"),
            (shm_payload, "not a torch shared-memory name"),
        ):
            reply = await asyncio.wait_for(
                served.http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [payload]}),
                30,
            )
            assert reply.status_code == 400 and needle in reply.json()["message"], reply.text
        assert _digest(served.engine) == before
    await _assert_serves(served)


# -- SIGTERM -------------------------------------------------------------------------------------


def test_sigterm_during_a_join_drains_and_exits(tmp_path: Path) -> None:
    """`lockstep engine` with a weight-group join in flight (its rendezvous would wait 300 s) and a
    running request exits on SIGTERM within its drain timeout; it used to wait for the join."""
    import os
    import signal
    import subprocess
    import sys
    import time

    port = _dead_port()
    log = (tmp_path / "engine.log").open("w")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "lockstep", "engine", "--model", "builtin:tiny", "--port", str(port)]
    cmd += ["--weight-group-timeout", "300", "--drain-timeout", "2", "--api-key", KEY]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "engine.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        body = {**_JOIN, "master_port": _dead_port()}
        joining = threading.Thread(
            target=lambda: httpx.post(
                f"{url}/init_weights_update_group", json=body, headers=auth, timeout=600
            ),
            daemon=True,
        )
        joining.start()
        while httpx.get(f"{url}/health", timeout=5).status_code == 200:
            time.sleep(0.05)
        gen = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 100000, "ignore_eos": True}}
        running = threading.Thread(target=_post_quietly, args=(f"{url}/generate", gen, auth), daemon=True)
        running.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "engine.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _post_quietly(url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    """A request the engine's shutdown cuts off (its connection drops): that is expected here."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url, json=body, headers=headers, timeout=600)
