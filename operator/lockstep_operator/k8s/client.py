"""The operator's Kubernetes client: server-side apply, create, get, list, delete, merge patch, discovery.

Why it exists: the reconciles need a handful of verbs on a known set of kinds, done the level-triggered
way (server-side apply with our field manager and force: the operator owns these fields, and two
replicas never fight over them). Credentials and transport are the maintained `kubernetes` client's
asyncio API (`kubernetes.aio`, on aiohttp like kopf): kubeconfig with exec credential plugins, or
in-cluster with the ServiceAccount token re-read per request (lockstep.kube); every call is retried on
429/5xx and on no answer, honouring Retry-After (lockstep.kube.RetryPolicy). Key material inline in a
kubeconfig goes into anonymous memory files (memfd), never into /tmp. Credentials are never logged.

Who calls it: the reconciles, the handlers (kopf's login gets the same credentials), e2e tests, bench.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

import aiohttp
from kubernetes.aio.client import ApiClient, Configuration
from kubernetes.aio.config import kube_config
from lockstep.kube import SERVICE_ACCOUNT_DIR, RetryPolicy, in_cluster, use_token_file

from lockstep_operator import metrics
from lockstep_operator.k8s.gate import RequestGate
from lockstep_operator.k8s.store import LISTED_KINDS, Store
from lockstep_operator.policy.request_priority import urgent
from lockstep_operator.settings import FIELD_MANAGER

Manifest = dict[str, Any]
log = logging.getLogger("lockstep_operator.k8s")

# apiVersion-independent kind -> (plural, namespaced). Only the kinds the operator touches.
KINDS: dict[str, tuple[str, bool]] = {
    "Pod": ("pods", True),
    "Service": ("services", True),
    "ConfigMap": ("configmaps", True),
    "Secret": ("secrets", True),
    "ServiceAccount": ("serviceaccounts", True),
    "Role": ("roles", True),
    "RoleBinding": ("rolebindings", True),
    "NetworkPolicy": ("networkpolicies", True),
    "Event": ("events", True),
    "Node": ("nodes", False),
    "Namespace": ("namespaces", False),
    "PodGroup": ("podgroups", True),
    "RLJob": ("rljobs", True),
    "RolloutPool": ("rolloutpools", True),
    "TrainerGroup": ("trainergroups", True),
    "WeightChannel": ("weightchannels", True),
    "CustomResourceDefinition": ("customresourcedefinitions", False),
    "ClusterKopfPeering": ("clusterkopfpeerings", False),
    "KopfPeering": ("kopfpeerings", True),
    "SandboxTemplate": ("sandboxtemplates", True),
    "SandboxWarmPool": ("sandboxwarmpools", True),
}
# Inline key material of a kubeconfig user/cluster -> the file key the library reads instead.
INLINE_FILES = {
    "client-certificate-data": "client-certificate",
    "client-key-data": "client-key",
    "certificate-authority-data": "certificate-authority",
}


class ApiError(Exception):
    """A non-2xx answer of the API server."""

    def __init__(self, status: int, reason: str, message: str, retry_after: str | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        """HTTP status code (404 not found, 409 conflict, ...)."""
        self.reason = reason
        """Kubernetes Status.reason (NotFound, AlreadyExists, ...)."""
        self.message = message
        """Kubernetes Status.message."""
        self.retry_after = retry_after
        """The Retry-After header, if the server sent one."""
        self.method = ""
        """The request's HTTP method (set by KubeClient.request)."""
        self.path = ""
        """The request's path (set by KubeClient.request)."""


@dataclass
class Credentials:
    """A loaded `kubernetes.aio` Configuration plus the memory files holding its key material."""

    configuration: Configuration
    """Server, TLS and the bearer token (refreshed per request by its hook)."""
    memory_fds: list[int] = field(default_factory=list)
    """memfd descriptors behind /proc/self/fd/N paths in the configuration (closed by close())."""

    def close(self) -> None:
        """Release the memory files (after every client built from these credentials is closed)."""
        for fd in self.memory_fds:
            os.close(fd)
        self.memory_fds.clear()


async def load_credentials(
    kubeconfig: str | None = None, *, sa_dir: Path = SERVICE_ACCOUNT_DIR
) -> Credentials:
    """From `kubeconfig`, else $KUBECONFIG, else the in-cluster ServiceAccount, else ~/.kube/config."""
    path = kubeconfig or os.environ.get("KUBECONFIG")
    configuration = Configuration()
    if not path and (sa_dir / "token").exists():
        in_cluster(configuration, sa_dir=sa_dir)
        return Credentials(configuration)
    merger = kube_config.KubeConfigMerger(path or str(Path.home() / ".kube" / "config"))  # type: ignore[no-untyped-call]
    if merger.config is None:
        raise ValueError(f"no kubeconfig at {path or '~/.kube/config'}: set KUBECONFIG or run in a pod")
    fds = _inline_files_to_memory(merger.config.value)
    loader = kube_config.KubeConfigLoader(config_dict=merger.config, config_base_path=None)  # type: ignore[no-untyped-call]
    await loader.load_and_set(configuration)  # type: ignore[no-untyped-call]
    user = loader._user  # the active context's user section (None without one)
    if user is not None and "tokenFile" in user and "token" not in user:
        base = loader._get_base_path(user.path)  # type: ignore[no-untyped-call]
        use_token_file(configuration, Path(base) / user["tokenFile"])
    elif user is not None and "exec" in user:
        configuration.refresh_api_key_hook = _exec_refresh(loader)  # type: ignore[assignment]
    return Credentials(configuration, fds)


def _inline_files_to_memory(config: dict[str, Any]) -> list[int]:
    """Replace inline base64 key material with /proc/self/fd/N paths of memfd files (Linux), so the
    library never writes a client key to a temp file. Elsewhere the library's temp files stay."""
    if not hasattr(os, "memfd_create"):
        return []
    fds: list[int] = []
    for item, section in (("users", "user"), ("clusters", "cluster")):
        for entry in config.get(item) or []:
            body = (entry.value if hasattr(entry, "value") else entry).get(section) or {}
            for data_key, file_key in INLINE_FILES.items():
                if body.get(data_key):
                    fd = os.memfd_create(file_key, os.MFD_CLOEXEC)
                    os.write(fd, base64.b64decode(body.pop(data_key)))
                    fds.append(fd)
                    body[file_key] = f"/proc/self/fd/{fd}"
    return fds


def _exec_refresh(loader: Any) -> Callable[[Configuration], Awaitable[None]]:
    """A hook running the exec credential plugin again once its token expired (when it said when)."""

    async def refresh(configuration: Configuration) -> None:
        if hasattr(loader, "exec_plugin_expiry"):  # the library re-runs the plugin only when expired
            await loader.load_from_exec_plugin()
            configuration.api_key["BearerToken"] = loader.token

    return refresh


def api_prefix(api_version: str) -> str:
    """/api/v1 for the core group, /apis/<group>/<version> otherwise."""
    return "/api/v1" if api_version == "v1" else f"/apis/{api_version}"


def resource_path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    """The REST path of a collection (name=None) or one object."""
    plural, namespaced = KINDS[kind]
    path = api_prefix(api_version)
    if namespaced and namespace:
        path += f"/namespaces/{quote(namespace)}"
    path += f"/{plural}"
    return path + (f"/{quote(name)}" if name else "")


def manifest_path(manifest: Mapping[str, Any], *, named: bool = True) -> str:
    """The REST path of `manifest` (of its collection with named=False)."""
    meta = manifest["metadata"]
    name = meta["name"] if named else None
    return resource_path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"), name)


def _cache_key(manifest: Mapping[str, Any]) -> tuple[str, str, str, str]:
    """The apply cache's key of an object: apiVersion, kind, namespace ("" when cluster-scoped), name."""
    meta = manifest["metadata"]
    return (manifest["apiVersion"], manifest["kind"], meta.get("namespace") or "", meta["name"])


def _digest(manifest: Mapping[str, Any]) -> str:
    """What the apply cache compares: a hash of the manifest's canonical JSON."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


class KubeClient:
    """Async client; use `async with KubeClient(await load_credentials()) as kube:`."""

    def __init__(
        self,
        credentials: Credentials,
        *,
        retry: RetryPolicy = RetryPolicy(),
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        timeout_s: float = 60.0,
        apply_cache_ttl_s: float = 60.0,
        gate: RequestGate | None = None,
    ) -> None:
        self.credentials = credentials
        """What this client authenticates with (kopf's login reads the same)."""
        self._api: ApiClient | None = None
        self._retry, self._sleep, self._timeout = retry, sleep, aiohttp.ClientTimeout(total=timeout_s)
        self._applied: dict[tuple[str, str, str, str], tuple[str, float]] = {}
        """Apply cache: key -> (digest of the manifest applied, when it expires)."""
        self._prune_at = 4096
        self._applying: dict[tuple[str, str, str, str], tuple[str, asyncio.Future[None]]] = {}
        self._ttl = apply_cache_ttl_s
        self.requests = 0
        """API requests made (the bench reports requests per job)."""
        self.store: Store | None = None
        """The watch-fed read cache (k8s/store.py): gets and pod lists come from it once it is synced,
        and every write's answer goes into it. None: every read goes to the API."""
        self._nodes: dict[str, tuple[Manifest, float]] = {}
        self.node_ttl_s = 30.0
        """How long a Node read is reused (labels and allocatable change rarely; placement reads many)."""
        self.gate = gate
        """Bounds this client's requests in flight and serves the urgent ones first (k8s/gate.py);
        None: every request goes at once (tests, benches)."""
        self.written: dict[tuple[str, str, str], str] = {}
        """(kind, namespace, name) -> resourceVersion of this client's last write of that object, so a
        watch event that only echoes it can be skipped: a /status write needs no pass of its object,
        and any other write that changed an object the store holds already called `on_write`."""
        self.on_write: Callable[[tuple[str, str, str]], None] | None = None
        """Called with (kind, namespace, name) when a write other than to /status changed an object the
        store holds. The operator kicks that object's pass at once (a job's new RolloutPool and
        TrainerGroup make their pods without waiting for their watch events: docs/operator.md,
        "Reconcile order"). None: nothing is called."""

    async def __aenter__(self) -> KubeClient:
        self._api = ApiClient(self.credentials.configuration)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._api is not None:
            await self._api.close()  # type: ignore[no-untyped-call]
            self._api = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: object = None,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
        first: bool | None = None,
    ) -> Manifest:
        """One API call, retried per the policy; the decoded JSON body; ApiError on a non-2xx answer.

        `first`: whether the gate serves it before the others; None: as policy.request_priority.urgent
        says (a caller names it only for a request the pods' path awaits that the policy cannot tell by
        its resource, such as the namespace's baseline NetworkPolicy)."""
        self.requests += 1
        resource = _resource_of(path)
        metrics.API_REQUESTS.labels(method, resource).inc()
        first = urgent(method, resource, content_type) if first is None else first
        attempt = 1
        while True:
            try:
                async with self._slot(first):
                    answer = await self._once(method, path, body, content_type, params)
            except ApiError as err:
                err.method, err.path = method, path
                delay = self._retry.delay(attempt, err.status, err.retry_after)
                if delay is None:
                    raise
                log.info("%s %s answered %d; retry %d in %.1fs", method, path, err.status, attempt, delay)
            except (aiohttp.ClientError, TimeoutError, OSError) as err:
                delay = self._retry.delay(attempt, None)
                if delay is None:
                    raise
                log.info("%s %s: %s; retry %d in %.1fs", method, path, type(err).__name__, attempt, delay)
            else:
                if method != "GET":
                    self._remember_write(path, answer)
                return answer
            await self._sleep(delay)
            attempt += 1

    @contextlib.asynccontextmanager
    async def _slot(self, first: bool) -> AsyncIterator[None]:
        """A slot of the gate for one attempt (none without a gate)."""
        if self.gate is None:
            yield
            return
        async with self.gate.slot(first):
            yield

    async def _once(
        self, method: str, path: str, body: object, content_type: str, params: Mapping[str, str] | None
    ) -> Manifest:
        assert self._api is not None, "use `async with KubeClient(...)`"
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        query = list(params.items()) if params else None
        # The body goes to call_api as it is (plain JSON; the REST layer json.dumps it): the library's
        # sanitize_for_serialization walks it in Python (4% of the operator's CPU in a burst).
        method, url, headers, _, post = await self._api.param_serialize(
            method, path, query_params=query, header_params=headers, body=None, auth_settings=["BearerToken"]
        )
        response = await self._api.call_api(method, url, headers, body, post, _request_timeout=self._timeout)
        data = await response.read()  # type: ignore[no-untyped-call]
        if response.status >= 300:
            raise _api_error(
                response.status, response.reason or "", data, response.headers.get("Retry-After")
            )
        return cast(Manifest, json.loads(data)) if data else {}

    def _remember_write(self, path: str, answer: Manifest) -> None:
        """A write's answer: into the store (a pass never reads older state than its own last write),
        its version into `written`, and `on_write` when it changed a held object's spec or metadata."""
        meta = answer.get("metadata")
        if "kind" not in answer or not isinstance(meta, dict):
            return  # a DELETE's Status, an empty answer
        key = (str(answer["kind"]), str(meta.get("namespace", "")), str(meta.get("name", "")))
        if len(self.written) > 16384:
            self.written.clear()
        self.written[key] = str(meta.get("resourceVersion", ""))
        changed = self.store is not None and self.store.observe(answer)
        if changed and self.on_write is not None and not path.endswith("/status"):
            self.on_write(key)

    async def apply(
        self,
        manifest: Mapping[str, Any],
        *,
        subresource: str | None = None,
        cache: bool = False,
        first: bool | None = None,
    ) -> Manifest:
        """Server-side apply with our field manager (force: the operator owns these fields).

        cache=True skips the request when the identical manifest was applied by this client less than
        the cache TTL ago (re-applying an unchanged object is a no-op on the server; a pass after the
        TTL re-applies it, so a child deleted or edited by hand comes back: docs/operator.md, "The
        Kubernetes client"; `forget_applied` ends an entry early), or waits for the
        identical apply already in flight (a burst's passes all wanting one shared object make one
        request). Returns {} then. `first`: as for `request`.
        """
        key = _cache_key(manifest)
        digest = _digest(manifest) if cache else ""
        hit = self._applied.get(key)
        if cache and hit is not None and hit[0] == digest and time.monotonic() < hit[1]:
            return {}
        pending = self._applying.get(key)
        if cache and pending is not None and pending[0] == digest:
            await asyncio.wait([pending[1]])  # raises only when this caller is cancelled
            if not pending[1].cancelled():  # else the first caller was cancelled: apply it here
                if (err := pending[1].exception()) is not None:
                    raise err  # the same answer as the first caller's
                return {}
        path = manifest_path(manifest) + (f"/{subresource}" if subresource else "")
        params = {"fieldManager": FIELD_MANAGER, "force": "true"}
        send = self.request(
            "PATCH",
            path,
            body=manifest,
            content_type="application/apply-patch+yaml",
            params=params,
            first=first,
        )
        if not cache:
            return await send
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._applying[key] = (digest, done)
        try:
            answer = await send
        except Exception as err:
            done.set_exception(err)
            done.exception()  # retrieved: no "never retrieved" warning when nobody else waits
            raise
        except BaseException:
            done.cancel()
            raise
        finally:
            if self._applying.get(key, (None, None))[1] is done:
                del self._applying[key]
        self.remember(manifest, digest=digest)  # remembered only once the server accepted it
        done.set_result(None)
        return answer

    def remember(self, manifest: Mapping[str, Any], *, digest: str | None = None) -> None:
        """Record `manifest` as applied now (apply's cache: an identical apply within the TTL is skipped);
        also for an object made by a create with the same content. Each entry's TTL is spread by up to
        a tenth either way, so the objects of jobs applied in one burst are not all sent again at once.
        `digest`: the manifest's, when the caller has it (apply: not hashed twice)."""
        key, digest = _cache_key(manifest), digest or _digest(manifest)
        now = time.monotonic()
        if len(self._applied) > self._prune_at:  # forget expired entries (objects of deleted jobs)
            self._applied = {k: v for k, v in self._applied.items() if now < v[1]}
            self._prune_at = max(4096, 2 * len(self._applied))  # amortized: not on every call at scale
        self._applied[key] = (digest, now + self._ttl * random.uniform(0.9, 1.1))

    def forget_applied(self, api_version: str, kind: str, namespace: str | None, name: str) -> None:
        """The object is gone (its DELETED event): the next apply of it is sent, whatever the cache says."""
        self._applied.pop((api_version, kind, namespace or "", name), None)  # as _cache_key

    async def create(self, manifest: Mapping[str, Any], *, field_manager: str = FIELD_MANAGER) -> Manifest:
        """Create `manifest` (POST to its collection); ApiError 409 AlreadyExists when it exists.

        Unlike apply, a create is an Update operation: `field_manager` owns the fields it set, so a
        later apply that leaves a field out (the pool's spec.replicas) does not take it away.
        """
        params = {"fieldManager": field_manager}
        return await self.request("POST", manifest_path(manifest, named=False), body=manifest, params=params)

    async def create_or_apply(self, manifest: Mapping[str, Any], *, cache: bool = False) -> Manifest:
        """Create `manifest`, or server-side apply it when it exists: for a pod the caller's store lacks
        and for objects that never change once made (a ServiceAccount). A create costs the API server
        less than an apply (no YAML to convert, no managed-field merge: server-side apply was 18% of
        its CPU in a 50-job burst, bench/results/operator_apply_2026-12-06_cpu.md), and a pod's spec
        cannot change anyway. An object that exists (the store's copy lags; a deleted pod still
        terminating) gets the apply it got before. cache=True: as for `apply`, and an object this
        client made or applied before goes straight to the apply (no create refused first)."""
        if cache and _cache_key(manifest) in self._applied:
            return await self.apply(manifest, cache=True)
        try:
            answer = await self.create(manifest)
        except ApiError as err:
            if err.status != 409:
                raise
            return await self.apply(manifest, cache=cache)
        if cache:
            self.remember(manifest)
        return answer

    async def get(
        self, api_version: str, kind: str, namespace: str | None, name: str, *, fresh: bool = False
    ) -> Manifest | None:
        """The object, or None when it does not exist (from the store when it holds it).

        fresh=True asks the API server even then (and keeps the answer in the store): for a decision
        that must not miss a write whose watch event may still be on its way (the watches of two kinds
        are separate streams, so one's newer event may arrive before the other's older one)."""
        if self.store is not None and self.store.holds(kind) and not fresh:
            return self.store.get(kind, namespace or "", name)  # the watch holds all of them
        if fresh:
            found = await self._get(api_version, kind, namespace, name)
            if found is not None and self.store is not None:
                self.store.observe(found)
            return found
        if kind == "Node":
            return await self._node(name)
        return await self._get(api_version, kind, namespace, name)

    async def _node(self, name: str) -> Manifest | None:
        hit = self._nodes.get(name)
        if hit is not None and time.monotonic() - hit[1] < self.node_ttl_s:
            return hit[0]
        node = await self._get("v1", "Node", None, name)
        if node is not None:
            if len(self._nodes) > 4096:
                self._nodes.clear()
            self._nodes[name] = (node, time.monotonic())
        return node

    async def _get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Manifest | None:
        try:
            return await self.request("GET", resource_path(api_version, kind, namespace, name))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def list(
        self, api_version: str, kind: str, namespace: str | None, *, selector: str | None = None
    ) -> list[Manifest]:
        """Items of a collection, optionally filtered by a label selector (pods: from the store)."""
        if self.store is not None and kind in LISTED_KINDS and self.store.holds(kind) and namespace:
            return self.store.list(kind, namespace, selector)
        params = {"labelSelector": selector} if selector else None
        answer = await self.request("GET", resource_path(api_version, kind, namespace), params=params)
        return cast(list[Manifest], answer.get("items", []))

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        """Delete (background propagation); False when it was already gone."""
        try:
            body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
            await self.request("DELETE", resource_path(api_version, kind, namespace, name), body=body)
            return True
        except ApiError as err:
            if err.status == 404:
                return False
            raise

    async def merge_patch(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str | None = None,
    ) -> Manifest:
        """A JSON merge patch (used for status and spec.replicas of our own objects)."""
        path = resource_path(api_version, kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return await self.request("PATCH", path, body=patch, content_type="application/merge-patch+json")

    async def has_api(self, group_version: str, kind: str) -> bool:
        """Whether the API server serves `kind` in `group_version` (e.g. a scheduler's PodGroup CRD)."""
        try:
            answer = await self.request("GET", api_prefix(group_version))
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        return any(r.get("kind") == kind for r in answer.get("resources", []))

    async def bearer_token(self) -> str | None:
        """The current bearer token (refreshed by the configuration's hook), for kopf's login."""
        header = await self.credentials.configuration.get_api_key_with_prefix("BearerToken")
        return header.split(" ", 1)[-1] if header else None


def _resource_of(path: str) -> str:
    """`pods`, `pods/status`, `rljobs` ... of an API path (the metric's label; never a name)."""
    parts = path.strip("/").split("/")
    parts = parts[2:] if parts[0] == "api" else parts[3:]  # drop api/v1 or apis/<group>/<version>
    if len(parts) >= 2 and parts[0] == "namespaces":
        parts = parts[2:]
    if not parts:
        return "discovery"
    return parts[0] + (f"/{parts[2]}" if len(parts) > 2 else "")


def _api_error(status: int, reason: str, data: bytes, retry_after: str | None) -> ApiError:
    """An ApiError from the API server's Status body (bounded; never the request's headers)."""
    try:
        body = json.loads(data)
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    text = data[:500].decode(errors="replace")
    return ApiError(status, str(body.get("reason") or reason), str(body.get("message") or text), retry_after)
