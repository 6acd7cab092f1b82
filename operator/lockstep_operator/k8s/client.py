"""A small async Kubernetes client: server-side apply, get, list, delete, status patches.

Why it exists: kopf watches and calls handlers, but creating children needs a client. The official
client is large and sync; the operator needs a handful of verbs on a known set of kinds, done the
level-triggered way (server-side apply with one field manager, so re-applying is idempotent and two
operator replicas never fight over fields). Built on aiohttp (already a kopf dependency).

Who calls it: `lockstep_operator.reconcile.*` (through `KubeClient`), the e2e tests and the bench
scripts. Credentials come from $KUBECONFIG (token, client certificate, CA) or the in-cluster service
account; they are never logged.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import ssl
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

import aiohttp
import yaml

from lockstep_operator import metrics
from lockstep_operator.settings import FIELD_MANAGER

Manifest = dict[str, Any]
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

# apiVersion-independent kind -> (plural, namespaced). Only the kinds the operator touches.
KINDS: dict[str, tuple[str, bool]] = {
    "Pod": ("pods", True),
    "Service": ("services", True),
    "ConfigMap": ("configmaps", True),
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
}


class ApiError(Exception):
    """A non-2xx answer of the API server."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        """HTTP status code (404 not found, 409 conflict, ...)."""
        self.reason = reason
        """Kubernetes Status.reason (NotFound, AlreadyExists, ...)."""
        self.message = message
        """Kubernetes Status.message."""


@dataclass(frozen=True, slots=True)
class Credentials:
    """Where and how to reach the API server (never logged)."""

    server: str
    """https://host:port of the API server."""
    token: str | None
    """Bearer token, if any."""
    ssl_context: ssl.SSLContext | bool
    """TLS settings: a context with the CA (and client cert), or False to skip verification."""


def load_credentials(kubeconfig: str | None = None) -> Credentials:
    """From the given kubeconfig, else $KUBECONFIG, else the in-cluster service account, else ~/.kube/config."""
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if not path and (SA_DIR / "token").exists():
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        ctx = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
        return Credentials(f"https://{host}:{port}", (SA_DIR / "token").read_text().strip(), ctx)
    path = path or str(Path.home() / ".kube" / "config")
    config = yaml.safe_load(Path(path.split(os.pathsep)[0]).read_text())
    current = config.get("current-context") or config["contexts"][0]["name"]
    context = next(c["context"] for c in config["contexts"] if c["name"] == current)
    cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
    user: dict[str, Any] = next(
        (u["user"] for u in config.get("users", []) if u["name"] == context.get("user")), {}
    )
    return Credentials(cluster["server"], _token(user), _ssl_context(cluster, user, Path(path).parent))


def _token(user: Mapping[str, Any]) -> str | None:
    if user.get("token"):
        return str(user["token"])
    if user.get("tokenFile"):
        return Path(user["tokenFile"]).read_text().strip()
    return None


def _materialize(data_b64: str) -> str:
    # ssl wants files; inline kubeconfig data goes to a private temp file.
    with tempfile.NamedTemporaryFile("wb", suffix=".pem", delete=False) as handle:
        handle.write(base64.b64decode(data_b64))
    return handle.name


def _ssl_context(cluster: Mapping[str, Any], user: Mapping[str, Any], base: Path) -> ssl.SSLContext | bool:
    if cluster.get("insecure-skip-tls-verify"):
        return False
    ca = cluster.get("certificate-authority")
    if cluster.get("certificate-authority-data"):
        ca = _materialize(cluster["certificate-authority-data"])
    ctx = ssl.create_default_context(cafile=str(base / ca) if ca else None)
    cert, key = user.get("client-certificate"), user.get("client-key")
    if user.get("client-certificate-data"):
        cert = _materialize(user["client-certificate-data"])
    if user.get("client-key-data"):
        key = _materialize(user["client-key-data"])
    if cert and key:
        ctx.load_cert_chain(str(base / cert), str(base / key))
    return ctx


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


class KubeClient:
    """Async client; use `async with KubeClient(credentials) as kube:`."""

    def __init__(self, credentials: Credentials, *, apply_cache_ttl_s: float = 60.0) -> None:
        self._creds = credentials
        self._session: aiohttp.ClientSession | None = None
        self._applied: dict[tuple[str, str, str, str], tuple[str, float]] = {}
        self._ttl = apply_cache_ttl_s
        self.requests = 0
        """API requests made (the bench reports requests per job)."""
        self.written: dict[tuple[str, str, str], str] = {}
        """(kind, namespace, name) -> resourceVersion of this client's last /status write of that object,
        so a watch event that is only the echo of a reconcile's own status write can be skipped. Only
        status writes: a parent's apply to a child (suspend, stop annotations) must wake the child."""

    async def __aenter__(self) -> KubeClient:
        headers = {"Authorization": f"Bearer {self._creds.token}"} if self._creds.token else {}
        connector = aiohttp.TCPConnector(ssl=self._creds.ssl_context, limit=32)
        self._session = aiohttp.ClientSession(self._creds.server, headers=headers, connector=connector)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: object = None,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> Manifest:
        """One API call; returns the decoded JSON body; raises ApiError on a non-2xx answer."""
        assert self._session is not None, "use `async with KubeClient(...)`"
        self.requests += 1
        metrics.API_REQUESTS.labels(method).inc()
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else {}
        async with self._session.request(method, path, data=data, headers=headers, params=params) as resp:
            text = await resp.text()
            if resp.status >= 300:
                try:
                    status = json.loads(text)
                except ValueError:
                    status = {"reason": resp.reason or "", "message": text[:500]}
                raise ApiError(resp.status, str(status.get("reason", "")), str(status.get("message", "")))
            answer = cast(Manifest, json.loads(text)) if text else {}
            if method == "PATCH" and path.endswith("/status") and isinstance(answer.get("metadata"), dict):
                meta = answer["metadata"]
                key = (str(answer.get("kind", "")), str(meta.get("namespace", "")), str(meta.get("name", "")))
                if len(self.written) > 16384:
                    self.written.clear()
                self.written[key] = str(meta.get("resourceVersion", ""))
            return answer

    async def apply(
        self, manifest: Mapping[str, Any], *, subresource: str | None = None, cache: bool = False
    ) -> Manifest:
        """Server-side apply with our field manager (force: the operator owns these fields).

        cache=True skips the request when the identical manifest was applied by this client less than
        the cache TTL ago (re-applying an unchanged object is a no-op on the server; the periodic
        re-check still re-applies after the TTL, so a deleted child comes back). Returns {} then.
        """
        meta = manifest["metadata"]
        key = (manifest["apiVersion"], manifest["kind"], meta.get("namespace") or "", meta["name"])
        digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest() if cache else ""
        hit = self._applied.get(key)
        if cache and hit is not None and hit[0] == digest and time.monotonic() - hit[1] < self._ttl:
            return {}
        path = resource_path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"])
        path += f"/{subresource}" if subresource else ""
        params = {"fieldManager": FIELD_MANAGER, "force": "true"}
        answer = await self.request(
            "PATCH", path, body=manifest, content_type="application/apply-patch+yaml", params=params
        )
        if cache:  # remembered only once the server accepted it
            now = time.monotonic()
            if len(self._applied) > 4096:  # forget expired entries (objects of deleted jobs)
                self._applied = {k: v for k, v in self._applied.items() if now - v[1] < self._ttl}
            self._applied[key] = (digest, now)
        return answer

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Manifest | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", resource_path(api_version, kind, namespace, name))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def list(
        self, api_version: str, kind: str, namespace: str | None, *, selector: str | None = None
    ) -> list[Manifest]:
        """Items of a collection, optionally filtered by a label selector."""
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
