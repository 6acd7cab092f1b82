"""The maintained Kubernetes client (kubernetes / kubernetes.aio) against the real local API server.

Why: the operator and the driver authenticate and write through the `kubernetes` package now; what a
user relies on is cluster-facing, so it is tested against the real kube-apiserver of the `cluster`
fixture: server-side apply under our field manager, create, a status merge patch, the in-cluster
ServiceAccount token read again after the kubelet rewrites it (operator and driver), a kubeconfig
whose user is an exec credential plugin (a real executable printing an ExecCredential), and inline
client keys that never reach /tmp. (Retries on 429/503 are tested on loopback: operator/tests.)
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from lockstep.api.progress import ProgressReport
from lockstep.progress import ConfigMapReporter
from lockstep_operator.k8s.client import ApiError, KubeClient, load_credentials
from lockstep_operator.k8s.store import Store
from lockstep_operator.settings import FIELD_MANAGER

from e2e.controlplane.cluster import ControlPlane

ROOT = Path(__file__).resolve().parent.parent
CM = {"apiVersion": "v1", "kind": "ConfigMap"}


def _sa_token(cluster: ControlPlane, ns: str, name: str, *, may_read: bool) -> str:
    """A real bound token of ServiceAccount `name` (allowed to get ConfigMaps of `ns` if may_read)."""
    cluster.kubectl("create", "serviceaccount", name, "-n", ns)
    if may_read:
        cluster.kubectl("create", "role", name, "--verb=get,patch", "--resource=configmaps", "-n", ns)
        cluster.kubectl(
            "create", "rolebinding", name, f"--role={name}", f"--serviceaccount={ns}:{name}", "-n", ns
        )
    return cluster.kubectl("create", "token", name, "-n", ns, "--duration=10m").stdout.strip()


def _install_crds(cluster: ControlPlane) -> None:
    for crd in sorted((ROOT / "crds").glob("rl.lockstep.dev_*.yaml")):
        cluster.apply(crd.read_text())
    cluster.kubectl("wait", "--for=condition=Established", "crd/rljobs.rl.lockstep.dev", "--timeout=60s")


@pytest.fixture
def sa_dir(cluster: ControlPlane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A mounted-ServiceAccount stand-in: ca.crt of the real cluster, the env of a pod, no KUBECONFIG."""
    url = urlsplit(cluster.api_url)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", str(url.hostname))
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(url.port))
    (tmp_path / "ca.crt").write_bytes(cluster.ca_file.read_bytes())
    yield tmp_path


async def test_apply_create_status_patch_on_the_real_apiserver(cluster: ControlPlane, namespace: str) -> None:
    _install_crds(cluster)
    async with KubeClient(await load_credentials(str(cluster.kubeconfig))) as kube:
        made = await kube.create(
            {**CM, "metadata": {"name": "made", "namespace": namespace}, "data": {"a": "1"}}
        )
        assert made["metadata"]["uid"]
        with pytest.raises(ApiError) as exists:
            await kube.create({**CM, "metadata": {"name": "made", "namespace": namespace}})
        assert (exists.value.status, exists.value.reason) == (409, "AlreadyExists")

        applied = await kube.apply(
            {**CM, "metadata": {"name": "made", "namespace": namespace}, "data": {"b": "2"}}
        )
        managers = {(m["manager"], m["operation"]) for m in applied["metadata"]["managedFields"]}
        assert (FIELD_MANAGER, "Apply") in managers and applied["data"] == {"a": "1", "b": "2"}

        job = yaml.safe_load((ROOT / "examples" / "tiny-local.yaml").read_text())
        job["metadata"] = {"name": "st", "namespace": namespace}
        await kube.create(job)
        patched = await kube.merge_patch(
            job["apiVersion"],
            "RLJob",
            namespace,
            "st",
            {"status": {"phase": "Pending"}},
            subresource="status",
        )
        assert patched["status"]["phase"] == "Pending"
        assert kube.written[("RLJob", namespace, "st")] == patched["metadata"]["resourceVersion"]
        got = await kube.get(job["apiVersion"], "RLJob", namespace, "st")
        assert got is not None and got["status"]["phase"] == "Pending"
        assert await kube.delete("v1", "ConfigMap", namespace, "made") is True
        assert await kube.get("v1", "ConfigMap", namespace, "made") is None


async def test_concurrent_identical_applies_make_one_request(cluster: ControlPlane, namespace: str) -> None:
    """A burst's passes all applying one shared object (the namespace's baseline NetworkPolicy) wait
    for the one request in flight; a refused one gives every waiter the API's error, and nothing is
    remembered, so the next apply is sent again."""
    shared = {**CM, "metadata": {"name": "shared", "namespace": namespace}, "data": {"a": "1"}}
    bad = {**CM, "metadata": {"name": "Not_A_Name", "namespace": namespace}}
    async with KubeClient(await load_credentials(str(cluster.kubeconfig))) as kube:
        before = kube.requests
        answers = await asyncio.gather(*(kube.apply(shared, cache=True, first=True) for _ in range(20)))
        assert kube.requests - before == 1
        assert sum(1 for a in answers if a) == 1  # the one that sent it has the object; the rest {}
        assert await kube.apply(shared, cache=True) == {}  # within the TTL: no request
        assert kube.requests - before == 1
        refused = await asyncio.gather(
            *(kube.apply(bad, cache=True) for _ in range(5)), return_exceptions=True
        )
        assert all(isinstance(e, ApiError) and e.status == 422 for e in refused), refused
        assert kube.requests - before == 2
        with pytest.raises(ApiError):
            await kube.apply(bad, cache=True)
        assert kube.requests - before == 3


async def test_create_or_apply_creates_a_new_object_and_applies_an_existing_one(
    cluster: ControlPlane, namespace: str
) -> None:
    """A new object goes by POST (an Update by our manager: no YAML, no managed-field merge); one that
    exists gets the apply (409, then apply, whose changes land); with cache=True an object this
    client made goes straight to the apply, or to nothing within the TTL."""
    made = {**CM, "metadata": {"name": "made-once", "namespace": namespace}, "data": {"a": "1"}}
    async with KubeClient(await load_credentials(str(cluster.kubeconfig))) as kube:
        first = await kube.create_or_apply(made)
        assert {(m["manager"], m["operation"]) for m in first["metadata"]["managedFields"]} == {
            (FIELD_MANAGER, "Update")
        }
        before = kube.requests
        again = await kube.create_or_apply({**made, "data": {"a": "2"}})
        assert kube.requests - before == 2 and again["data"] == {"a": "2"}  # refused create, then apply
        cached = {**made, "metadata": {**made["metadata"], "name": "made-cached"}}
        await kube.create_or_apply(cached, cache=True)
        before = kube.requests
        assert await kube.create_or_apply(cached, cache=True) == {}  # within the TTL: nothing sent
        assert kube.requests == before


async def test_the_apply_cache_sends_an_unchanged_object_again_only_after_its_refresh_or_when_forgotten(
    cluster: ControlPlane, namespace: str
) -> None:
    """An identical apply within the refresh period sends nothing; a changed one is sent at once; after
    the period (spread by a tenth either way) or `forget_applied` (the object's DELETED event) it is
    sent again, and a deleted object comes back."""
    cm = {**CM, "metadata": {"name": "refreshed", "namespace": namespace}, "data": {"a": "1"}}
    async with KubeClient(await load_credentials(str(cluster.kubeconfig)), apply_cache_ttl_s=1.0) as kube:
        await kube.apply(cm, cache=True)
        before = kube.requests
        assert await kube.apply(cm, cache=True) == {} and kube.requests == before
        await kube.apply({**cm, "data": {"a": "2"}}, cache=True)  # changed: sent
        assert kube.requests == before + 1
        await asyncio.sleep(1.2)  # past the refresh, whatever its spread
        await kube.apply({**cm, "data": {"a": "2"}}, cache=True)
        assert kube.requests == before + 2
        cluster.kubectl("delete", "configmap", "refreshed", "-n", namespace)
        assert await kube.apply({**cm, "data": {"a": "2"}}, cache=True) == {}  # trusted: not sent
        kube.forget_applied("v1", "ConfigMap", namespace, "refreshed")
        await kube.apply({**cm, "data": {"a": "2"}}, cache=True)
        assert kube.requests == before + 3
    assert cluster.get("configmap", "refreshed", "-n", namespace)["data"] == {"a": "2"}


async def test_a_write_that_changed_a_held_object_is_reported_once(
    cluster: ControlPlane, namespace: str
) -> None:
    """`on_write` (the operator kicks the object's pass with it) is called for a create and for an
    apply that changed the object, not for an apply the server found unchanged nor for a /status
    write; every write's version is in `written` (its watch event is then an echo)."""
    _install_crds(cluster)
    job = yaml.safe_load((ROOT / "examples" / "tiny-local.yaml").read_text())
    job["metadata"] = {"name": "told", "namespace": namespace}
    key = ("RLJob", namespace, "told")
    async with KubeClient(await load_credentials(str(cluster.kubeconfig))) as kube:
        kube.store, calls = Store(), []
        kube.on_write = calls.append
        made = await kube.create(job)
        assert calls == [key] and kube.written[key] == made["metadata"]["resourceVersion"]
        await kube.apply(job)  # the first apply after a create: the server records its managed fields
        assert calls == [key, key]
        await kube.apply(job)  # the same again: the server changes nothing, the version stays
        assert calls == [key, key]
        await kube.merge_patch(job["apiVersion"], "RLJob", namespace, "told", {"status": {"phase": "Pending"}},
                               subresource="status")  # fmt: skip
        assert calls == [key, key]
        changed = await kube.apply({**job, "metadata": {**job["metadata"], "labels": {"a": "b"}}})
        assert calls == [key] * 3 and kube.written[key] == changed["metadata"]["resourceVersion"]


async def test_in_cluster_token_is_read_again_after_rotation(
    cluster: ControlPlane, namespace: str, sa_dir: Path
) -> None:
    """The operator in a pod: the kubelet rewrites the token file; the next call sends the new one."""
    cluster.kubectl("create", "configmap", "probe", "-n", namespace)
    reader = _sa_token(cluster, namespace, "reader", may_read=True)
    other = _sa_token(cluster, namespace, "other", may_read=False)
    (sa_dir / "token").write_text(reader)
    async with KubeClient(await load_credentials(sa_dir=sa_dir)) as kube:
        got = await cluster_allows(kube, namespace)
        assert got is not None and got["metadata"]["name"] == "probe"
        (sa_dir / "token").write_text(other)  # rotated between two calls
        with pytest.raises(ApiError) as denied:
            await kube.get("v1", "ConfigMap", namespace, "probe")
        assert (
            denied.value.status == 403 and f"system:serviceaccount:{namespace}:other" in denied.value.message
        )


async def cluster_allows(kube: KubeClient, namespace: str) -> dict[str, Any] | None:
    """GET the probe ConfigMap, waiting for a fresh RoleBinding to reach the authorizer."""
    for _ in range(50):
        try:
            return await kube.get("v1", "ConfigMap", namespace, "probe")
        except ApiError as err:
            if err.status != 403:
                raise
        await asyncio.sleep(0.2)
    return await kube.get("v1", "ConfigMap", namespace, "probe")


def test_driver_reporter_reads_the_rotated_token(
    cluster: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    """The driver in a pod: a report after the token file was rewritten authenticates as the new token."""
    cluster.kubectl("create", "configmap", "j-progress", "-n", namespace)
    token = tmp_path / "token"
    token.write_text(_sa_token(cluster, namespace, "driver", may_read=True))
    rep = ConfigMapReporter(
        cluster.api_url, namespace, "j-progress", token_path=token, ca_path=cluster.ca_file, attempts=1
    )
    cluster.wait_for(
        lambda: rep.report(ProgressReport(step=1)), timeout=15, what="the driver's patch to be allowed"
    )
    token.write_text(_sa_token(cluster, namespace, "stranger", may_read=False))
    assert rep.report(ProgressReport(step=2)) is False
    assert "HTTP 403" in rep.last_error and f"system:serviceaccount:{namespace}:stranger" in rep.last_error
    data = cluster.get("configmap", "j-progress", "-n", namespace)["data"]
    assert json.loads(data["progress.json"])["step"] == 1


def _exec_kubeconfig(cluster: ControlPlane, tmp: Path, *, expires: dt.datetime) -> tuple[Path, Path]:
    """A kubeconfig whose user is an exec plugin: a script that counts its runs and prints the token."""
    runs = tmp / "runs"
    script = tmp / "credential-plugin"
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {
            "token": cluster.admin_token,
            "expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
    }
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"open({str(runs)!r}, 'a').write('run\\n')\n"
        "assert json.loads(os.environ['KUBERNETES_EXEC_INFO'])['kind'] == 'ExecCredential'\n"
        f"print(json.dumps({credential!r}))\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": cluster.api_url, "certificate-authority": str(cluster.ca_file)}}],
        "users": [{"name": "u", "user": {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": str(script), "interactionMode": "Never"}}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }  # fmt: skip
    path = tmp / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path, runs


@pytest.mark.parametrize(
    ("lifetime_s", "runs_after_two_calls"), [(3600, 1), (-60, 3)], ids=["valid", "expired"]
)
async def test_exec_plugin_kubeconfig(
    cluster: ControlPlane, tmp_path: Path, lifetime_s: int, runs_after_two_calls: int
) -> None:
    """A laptop against EKS/GKE: the credential comes from a plugin; it runs again only once expired."""
    expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=lifetime_s)
    path, runs = _exec_kubeconfig(cluster, tmp_path, expires=expires)
    async with KubeClient(await load_credentials(str(path))) as kube:
        for _ in range(2):
            assert await kube.get("v1", "Namespace", None, "default") is not None
    assert runs.read_text().count("run") == runs_after_two_calls


def _throwaway_client_pair(tmp: Path) -> tuple[bytes, bytes]:
    key, cert = tmp / "k.pem", tmp / "c.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=lockstep-e2e",
         "-days", "1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    out = key.read_bytes(), cert.read_bytes()
    key.unlink()
    cert.unlink()
    return out


def _files_containing(root: str, needle: bytes, since: float) -> list[str]:
    """Regular files directly in `root` (where mkstemp and NamedTemporaryFile write), changed since
    `since`, up to 64 KiB (key files are small), that contain `needle`."""
    found = []
    with os.scandir(root) as entries:
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
                fresh = stat.S_ISREG(st.st_mode) and st.st_mtime >= since and st.st_size <= 65536
                if fresh and needle in Path(entry.path).read_bytes():
                    found.append(entry.path)
            except OSError:
                continue
    return found


async def test_inline_client_keys_never_reach_tmp(cluster: ControlPlane, tmp_path: Path) -> None:
    """Inline kubeconfig keys are held in memory files; the old client left them in /tmp for good."""
    since = time.time() - 1
    key, cert = _throwaway_client_pair(tmp_path)
    marker = key.splitlines()[1]  # a line of the key's base64 body
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    config["clusters"][0]["cluster"] = {
        "server": cluster.api_url,
        "certificate-authority-data": base64.b64encode(cluster.ca_file.read_bytes()).decode(),
    }
    config["users"][0]["user"].update(
        {
            "client-key-data": base64.b64encode(key).decode(),
            "client-certificate-data": base64.b64encode(cert).decode(),
        }
    )
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    creds = await load_credentials(str(path))
    async with KubeClient(creds) as kube:  # TLS with that client certificate; authenticated by the token
        assert await kube.get("v1", "Namespace", None, "default") is not None
        assert _files_containing(tempfile.gettempdir(), marker, since) == []
    creds.close()
    assert _files_containing(tempfile.gettempdir(), marker, since) == []


def test_operator_watches_and_reconciles_through_an_exec_plugin(
    cluster: ControlPlane, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kopf's watches and the reconciles both log in through the exec plugin (one credential loader)."""
    from kopf.testing import KopfRunner

    _install_crds(cluster)
    path, runs = _exec_kubeconfig(cluster, tmp_path, expires=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))
    monkeypatch.setenv("KUBECONFIG", str(path))
    job = yaml.safe_load((ROOT / "examples" / "tiny-local.yaml").read_text())
    job["metadata"] = {"name": "viaexec"}
    args = ["run", "--standalone", "--namespace", namespace, "-m", "lockstep_operator.handlers"]
    with KopfRunner(args, timeout=60):
        cluster.apply(job, namespace=namespace)
        cluster.wait_for(
            lambda: (
                cluster.kubectl("get", "configmap", "viaexec-config", "-n", namespace, check=False).returncode
                == 0
            ),
            timeout=60,
            what="the job's config ConfigMap, applied by an operator logged in through the exec plugin",
        )
    assert runs.read_text().count("run") >= 1
