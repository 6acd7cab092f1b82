"""Retries of the operator's API client on 429 and 5xx, honouring Retry-After, on a loopback server.

The real API server cannot be made to answer 429 or 503 on demand, so this one behaviour is tested
against a loopback HTTP server of our own that answers a scripted sequence of statuses; everything
else about the client runs against the real API server (e2e/test_kube_client.py). The sleeps are
injected: the test records the delays instead of waiting them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest
from kubernetes.aio.client import Configuration
from lockstep.kube import RetryPolicy
from lockstep_operator.k8s.client import ApiError, Credentials, KubeClient


class _Scripted(BaseHTTPRequestHandler):
    """Answers each request with the next (status, headers) of `script`, then 200 with a ConfigMap."""

    script: ClassVar[list[tuple[int, dict[str, str]]]] = []
    seen: ClassVar[list[tuple[str, str]]] = []

    def _answer(self) -> None:
        self.seen.append((self.command, self.path))
        if self.headers.get("Content-Length"):
            self.rfile.read(int(self.headers["Content-Length"]))
        status, headers = self.script.pop(0) if self.script else (200, {})
        body = {"kind": "Status", "reason": "TooManyRequests", "message": "slow down"} if status >= 300 else {
            "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "ns"}}  # fmt: skip
        data = json.dumps(body).encode()
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", **headers}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PATCH = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Scripted]]]:
    handler = type("Handler", (_Scripted,), {"script": [], "seen": []})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    srv.shutdown()
    srv.server_close()


def _client(url: str, slept: list[float], attempts: int = 4) -> KubeClient:
    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    return KubeClient(
        Credentials(Configuration(host=url)), retry=RetryPolicy(attempts=attempts, initial_s=0.2), sleep=sleep
    )


@pytest.mark.parametrize(
    ("script", "slept"),
    [
        ([(429, {"Retry-After": "3"})], [3.0]),  # the server's hint wins
        ([(503, {})], [0.2]),  # no hint: the backoff
        ([(500, {}), (502, {}), (504, {})], [0.2, 0.4, 0.8]),  # doubling
        ([(429, {"Retry-After": "soon"})], [0.2]),  # not integer seconds: the backoff
    ],
    ids=["429-retry-after", "503", "5xx-doubling", "bad-retry-after"],
)
async def test_throttled_and_failed_answers_are_retried(
    server: tuple[str, type[_Scripted]], script: list[tuple[int, dict[str, str]]], slept: list[float]
) -> None:
    url, handler = server
    handler.script.extend(script)
    waited: list[float] = []
    async with _client(url, waited) as kube:
        got = await kube.get("v1", "ConfigMap", "ns", "x")
    assert got is not None and got["metadata"]["name"] == "x"
    assert waited == slept and len(handler.seen) == len(script) + 1


async def test_server_side_apply_is_retried_too(server: tuple[str, type[_Scripted]]) -> None:
    url, handler = server
    handler.script.append((429, {"Retry-After": "1"}))
    waited: list[float] = []
    async with _client(url, waited) as kube:
        await kube.apply(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "ns"}}
        )
    assert waited == [1.0] and [m for m, _ in handler.seen] == ["PATCH", "PATCH"]
    assert handler.seen[0][1].endswith("fieldManager=lockstep-operator&force=true")


async def test_refusals_are_not_retried_and_retries_end(server: tuple[str, type[_Scripted]]) -> None:
    url, handler = server
    handler.script.append((403, {}))
    waited: list[float] = []
    async with _client(url, waited, attempts=3) as kube:
        with pytest.raises(ApiError) as refused:
            await kube.get("v1", "ConfigMap", "ns", "x")
        assert refused.value.status == 403 and waited == []
        handler.script.extend([(503, {})] * 3)
        with pytest.raises(ApiError) as gave_up:
            await kube.get("v1", "ConfigMap", "ns", "x")
    assert gave_up.value.status == 503 and waited == [0.2, 0.4]  # 3 attempts in all


async def test_no_answer_is_retried() -> None:
    waited: list[float] = []
    async with _client("http://127.0.0.1:9", waited, attempts=3) as kube:
        with pytest.raises(OSError):
            await kube.get("v1", "ConfigMap", "ns", "x")
    assert waited == [0.2, 0.4]
