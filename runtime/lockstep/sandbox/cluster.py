"""Sandbox pods in a cluster: one SandboxClaim per episode on the job's warm pool (kubernetes-sigs/agent-sandbox).

Why it exists: in a cluster every episode runs in its own pod built from the task's image. The
operator owns the job's SandboxTemplate and SandboxWarmPool (lockstep_operator.resources.sandbox);
this provider claims one sandbox per episode (a SandboxClaim adopts a ready pod of the warm pool, or
starts one when the pool is empty), runs commands in its pod through the Kubernetes API (pods/exec,
`sh -c` in the working directory under `timeout`), and deletes the claim at release, which deletes
the Sandbox and its pod (owner references).

Why the Kubernetes API and not the `k8s-agent-sandbox` client: that client runs commands through an
HTTP runtime server inside the sandbox image (reached through agent-sandbox's router or the pod IP);
a task's own image (terminal-bench ships one per task) runs no such server, and pods/exec works with
any image that has a shell. Claims are plain custom objects, so the one `kubernetes` client the
driver already uses does both.

No leaked claim: every claim carries the label rl.lockstep.dev/sandbox-of=<job> and, in a driver pod,
an owner reference to that pod (POD_NAME, LOCKSTEP_POD_UID): a replaced driver pod takes its
claims with it, and a driver that starts again in the same pod deletes its job's claims before it
claims any (it is the job's only claimer). Deleting the job deletes the driver pod, the template and
the warm pool, hence every claim, Sandbox and pod.

Failures: a claim not ready within `claim_timeout_s` (ClaimTimeout), refused (ClaimFailed), a pod that
is gone or an exec that breaks (SandboxLost) raise SandboxError: the episode's sample is aborted.

Who calls it: lockstep.driver.sandboxes (a driver pod with LOCKSTEP_SANDBOX_WARMPOOL), e2e tests,
bench/sandbox_cluster.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import queue
import secrets
import shlex
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final

from lockstep.kube import api_client
from lockstep.sandbox.base import TIMEOUT_EXIT, ExecResult, SandboxConfig, SandboxError, cut_output

log = logging.getLogger(__name__)

GROUP: Final = "extensions.agents.x-k8s.io"
VERSION: Final = "v1beta1"
SANDBOX_OF_LABEL: Final = "rl.lockstep.dev/sandbox-of"
"""The label of a job's claims (and its sandbox pods): the job's name."""
CONTAINER: Final = "sandbox"
_POLL_S = 0.05
"""The GET interval when the claim cannot be watched (a Role without `watch`, a watch that broke)."""


@dataclass(slots=True)
class ClusterSandbox:
    """One claimed sandbox: its pod, and commands run in it by exec."""

    name: str
    """The claim's name."""
    pod: str
    """The sandbox pod."""
    namespace: str
    config: SandboxConfig
    provider: ClusterSandboxProvider

    async def exec(self, command: str, *, timeout_s: float | None = None) -> ExecResult:
        """Run `command` with `sh -c` in the working directory; killed at its deadline (exit 124)."""
        deadline = self.config.command_timeout_s if timeout_s is None else timeout_s
        result: ExecResult = await self.provider.run(self._exec, command, deadline)
        return result

    def _exec(self, command: str, deadline: float) -> ExecResult:
        from kubernetes.client import CoreV1Api
        from kubernetes.client.exceptions import ApiException
        from kubernetes.stream import stream

        seconds = max(1, math.ceil(deadline))
        script = (
            f"cd {shlex.quote(self.config.working_dir)} && "
            f"exec timeout -s KILL {seconds} sh -c {shlex.quote(command)} 2>&1"
        )
        t0 = time.monotonic()
        api = self.provider.exec_client()
        try:
            ws = stream(
                CoreV1Api(api).connect_get_namespaced_pod_exec,
                self.pod, self.namespace, container=CONTAINER, command=["sh", "-c", script],
                stdout=True, stderr=True, stdin=False, tty=False, _preload_content=False,
            )  # fmt: skip
        except (ApiException, OSError, ValueError) as e:  # the pod is gone or its kubelet unreachable
            self.provider.exec_clients.put(api)
            raise SandboxError(
                f"sandbox {self.name}: exec into pod {self.pod} failed: {e}", "SandboxLost"
            ) from e
        kept, limit = bytearray(), self.config.output_limit
        try:
            while True:
                open_ = ws.is_open() and time.monotonic() - t0 < seconds + 10
                if open_:
                    ws.update(timeout=1)
                for chunk in (ws.read_stdout(), ws.read_stderr()):  # what arrived, also after the close
                    if chunk and len(kept) <= limit:
                        kept.extend(chunk.encode()[: limit + 1 - len(kept)])
                if not open_:
                    break
            code = ws.returncode if not ws.is_open() else None
        except Exception as e:  # a broken websocket: the pod died under the command
            raise SandboxError(
                f"sandbox {self.name}: exec in pod {self.pod} broke: {e}", "SandboxLost"
            ) from e
        finally:
            ws.close()
            self.provider.exec_clients.put(api)
        elapsed = time.monotonic() - t0
        if code is None or (code >= 128 and not self._pod_alive()):  # killed by a signal: was it the pod?
            raise SandboxError(f"sandbox {self.name}: pod {self.pod} stopped or is gone", "SandboxLost")
        timed_out = code == 137 and elapsed >= seconds - 0.5  # timeout -s KILL: 128 + 9
        text, cut = cut_output(bytes(kept), limit)
        return ExecResult(TIMEOUT_EXIT if timed_out else int(code), text, timed_out=timed_out, truncated=cut,
                          seconds=elapsed)  # fmt: skip

    def _pod_alive(self) -> bool:
        """Whether the sandbox pod still runs (not deleted, not terminating, phase Running)."""
        from kubernetes.client import CoreV1Api
        from kubernetes.client.exceptions import ApiException

        try:
            pod = CoreV1Api(self.provider.api).read_namespaced_pod(self.pod, self.namespace)
        except ApiException:
            return False
        meta, status = pod.metadata, pod.status
        return (
            meta is not None
            and meta.deletion_timestamp is None
            and status is not None
            and status.phase == "Running"
        )


@dataclass(slots=True)
class ClusterSandboxProvider:
    """Claims from warm pool `warm_pool` of `namespace` for job `job`, at most `max_sandboxes` at once."""

    config: SandboxConfig
    namespace: str
    warm_pool: str
    job: str
    max_sandboxes: int = 64
    """Claims held at once; later episodes wait."""
    claim_timeout_s: float = 300.0
    """How long a claim may take to become ready (a cold start pulls and starts a pod)."""
    owner_pod: tuple[str, str] | None = None
    """(name, uid) of the driver pod that owns every claim; default from POD_NAME, LOCKSTEP_POD_UID."""
    api: Any = None
    """The `kubernetes` ApiClient (api_client() when None)."""
    live: dict[str, str] = field(default_factory=dict)
    """Claim names held, by episode key."""
    claim_seconds: list[float] = field(default_factory=list)
    """Seconds from create to ready of every claim (bench)."""
    exec_clients: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    """Idle ApiClients for execs and claim watches (exec_client says why they are apart)."""
    watch: bool = True
    """Watch each claim until it is ready (False: poll it every _POLL_S; set when a watch is refused)."""
    _watch_refused: bool = False
    _slots: asyncio.Semaphore | None = None
    _cleaning: asyncio.Lock | None = None
    _pool: ThreadPoolExecutor | None = None
    _cleaned: bool = False

    def __post_init__(self) -> None:
        if self.api is None:
            self.api = api_client()
        if self.owner_pod is None and os.environ.get("LOCKSTEP_POD_UID"):
            self.owner_pod = (os.environ.get("POD_NAME", ""), os.environ["LOCKSTEP_POD_UID"])
        self._pool = ThreadPoolExecutor(max_workers=self.max_sandboxes + 4, thread_name_prefix="sandbox")

    def exec_client(self) -> Any:
        """An ApiClient for one exec at a time. The `kubernetes` stream() swaps its client's request
        method for a websocket one while it connects, so a claim's GET on the same client from another
        thread went out as a websocket handshake ("Handshake status 200 OK"): execs never share the
        provider's client, nor one another's while running."""
        from kubernetes.client import ApiClient

        try:
            return self.exec_clients.get_nowait()
        except queue.Empty:
            return ApiClient(self.api.configuration)

    async def run(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the provider's threads (the `kubernetes` client blocks)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    @contextlib.asynccontextmanager
    async def claim(self, key: str) -> AsyncIterator[ClusterSandbox]:
        """A sandbox for episode `key` from the warm pool, released (claim deleted) on exit."""
        if self._slots is None:
            self._slots, self._cleaning = asyncio.Semaphore(self.max_sandboxes), asyncio.Lock()
        assert self._cleaning is not None
        async with self._cleaning:  # the first claim deletes what an earlier driver left; the others wait
            if not self._cleaned:
                await self.run(self.delete_leftovers)
                self._cleaned = True
        async with self._slots:
            name = claim_name(self.job, key)
            self.live[key] = name
            try:
                t0 = time.monotonic()
                version = await self.run(self._create, name)
                pod = await self._ready(name, version)
                self.claim_seconds.append(time.monotonic() - t0)
                yield ClusterSandbox(name, pod, self.namespace, self.config, self)
            finally:
                self.live.pop(key, None)
                await self.run(self._delete, name)

    def delete_leftovers(self) -> int:
        """Delete every claim of this job (a driver that started again in the same pod); how many."""
        from kubernetes.client import CustomObjectsApi

        api = CustomObjectsApi(self.api)
        listed: Any = api.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "sandboxclaims", label_selector=f"{SANDBOX_OF_LABEL}={self.job}"
        )
        found = listed["items"]
        for item in found:
            self._delete(item["metadata"]["name"])
        if found:
            log.info("deleted %d sandbox claims a previous driver of %s left", len(found), self.job)
        return len(found)

    def _create(self, name: str) -> str:
        """Create claim `name`; its resourceVersion (where the watch for its readiness starts)."""
        from kubernetes.client import CustomObjectsApi
        from kubernetes.client.exceptions import ApiException

        meta: dict[str, Any] = {"name": name, "labels": {SANDBOX_OF_LABEL: self.job}}
        if self.owner_pod is not None:
            pod, uid = self.owner_pod
            meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid}]
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "SandboxClaim",
            "metadata": meta,
            "spec": {"warmPoolRef": {"name": self.warm_pool}},
        }
        try:
            created: Any = CustomObjectsApi(self.api).create_namespaced_custom_object(
                GROUP, VERSION, self.namespace, "sandboxclaims", body
            )
        except ApiException as e:
            raise SandboxError(
                f"claim {name} on warm pool {self.warm_pool} refused: {e.status} {e.reason}", "ClaimFailed"
            ) from e
        return str(created["metadata"]["resourceVersion"])

    async def _ready(self, name: str, version: str) -> str:
        """Wait until claim `name` holds a ready sandbox; its pod's name. Watched from the create's
        resourceVersion (the controller's Ready arrives as it is written: no poll interval, no GET per
        interval on a loaded API server); polled with GETs when the watch is refused or breaks."""
        deadline = time.monotonic() + self.claim_timeout_s
        if self.watch:
            watched: str | None = await self.run(self._watch_ready, name, version, deadline)
            if watched:
                return watched
        while time.monotonic() < deadline:
            pod = await self.run(self._pod_if_ready, name)
            if pod:
                return str(pod)
            await asyncio.sleep(_POLL_S)
        raise SandboxError(
            f"claim {name} had no ready sandbox after {self.claim_timeout_s:g} s", "ClaimTimeout"
        )

    def _watch_ready(self, name: str, version: str, deadline: float) -> str | None:
        """Claim `name`'s pod once a watch from `version` sees it ready; None when the watch is refused
        (a Role without `watch`: said once), breaks or ends (the caller polls until `deadline`)."""
        from kubernetes import watch
        from kubernetes.client import CustomObjectsApi
        from kubernetes.client.exceptions import ApiException

        api = self.exec_client()  # its own connection: a watch holds one while it waits
        w = watch.Watch()  # type: ignore[no-untyped-call]
        try:
            for event in w.stream(  # type: ignore[no-untyped-call]
                CustomObjectsApi(api).list_namespaced_custom_object, GROUP, VERSION, self.namespace,
                "sandboxclaims", field_selector=f"metadata.name={name}", resource_version=version,
                timeout_seconds=max(1, math.ceil(deadline - time.monotonic())),
            ):  # fmt: skip
                claim = event.get("object")
                if event.get("type") == "DELETED":
                    raise SandboxError(f"claim {name} was deleted before it was ready", "ClaimFailed")
                pod = ready_pod(claim) if isinstance(claim, Mapping) else None
                if pod:
                    return pod
        except ApiException as e:
            if e.status == 403 and not self._watch_refused:
                self._watch_refused = True
                log.warning(
                    "watching sandbox claims in %s: 403 %s; polling them every %g s instead (grant the "
                    "driver verb watch on sandboxclaims of extensions.agents.x-k8s.io)",
                    self.namespace, e.reason, _POLL_S,
                )  # fmt: skip
            if e.status == 403:
                self.watch = False
        except (OSError, ValueError) as e:  # a broken stream: poll for the rest
            log.info("watch of sandbox claim %s broke (%s): polling it", name, e)
        finally:
            w.stop()  # type: ignore[no-untyped-call]
            self.exec_clients.put(api)
        return None

    def _pod_if_ready(self, name: str) -> str | None:
        from kubernetes.client import CustomObjectsApi
        from kubernetes.client.exceptions import ApiException

        try:
            claim: Any = CustomObjectsApi(self.api).get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, "sandboxclaims", name
            )
        except ApiException as e:
            raise SandboxError(f"claim {name}: {e.status} {e.reason}", "ClaimFailed") from e
        return ready_pod(claim)

    def _delete(self, name: str) -> None:
        from kubernetes.client import CustomObjectsApi, V1DeleteOptions
        from kubernetes.client.exceptions import ApiException

        try:
            CustomObjectsApi(self.api).delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, "sandboxclaims", name,
                body=V1DeleteOptions(propagation_policy="Background"),
            )  # fmt: skip
        except ApiException as e:
            if e.status != 404:
                log.warning("deleting sandbox claim %s: %s %s", name, e.status, e.reason)

    async def aclose(self) -> None:
        """Delete every claim still held, then stop the threads."""
        for name in list(self.live.values()):
            await self.run(self._delete, name)
        self.live.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def ready_pod(claim: Mapping[str, Any]) -> str | None:
    """The pod of a claim whose sandbox is Ready, else None (pure). agent-sandbox v1.0.1's warm pool
    makes whole Sandboxes, each running a pod of its own name (controllers/sandbox_controller.go,
    resolvePodName: the pod-name annotation is only on Sandboxes adopted before that), so the claim's
    status.sandbox.name is the pod's: no GET of the Sandbox."""
    status: Mapping[str, Any] = claim.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    box = (status.get("sandbox") or {}).get("name")
    return str(box) if ready and box else None


def claim_name(job: str, key: str) -> str:
    """A DNS-1123 name for episode `key`'s claim: job, key, a random suffix (unique across restarts)."""
    safe = "".join(c if c.isalnum() else "-" for c in key.lower()).strip("-")
    return f"{job[:30]}-{safe[:24]}-{secrets.token_hex(3)}".replace("--", "-")
