"""The real worker node: pods run real processes through kubelet -> containerd -> runc, get an IP on
the CNI bridge, resolve Service names through CoreDNS, reach Services through kube-proxy, and the
node leaves nothing behind when it stops. (docs/controlplane.md, "A real node".)"""

from __future__ import annotations

import ipaddress
import subprocess
from pathlib import Path
from typing import Any

import pytest
from lockstep.api.images import image_ref

from e2e.controlplane.cluster import ControlPlane
from e2e.controlplane.nodes import NodePool
from e2e.controlplane.realnode import REAL_NODE_LABEL, pod_manifest


def _busybox(cluster: ControlPlane) -> str:
    assert cluster.node is not None
    return cluster.node.images["busybox"]


def _finished(cluster: ControlPlane, ns: str, name: str, timeout: float = 120) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        pod: dict[str, Any] = cluster.get("pod", name, "-n", ns)
        return pod if pod["status"].get("phase") in ("Succeeded", "Failed") else None

    try:
        return cluster.wait_for(done, timeout=timeout, what=f"pod {ns}/{name} finished")
    except TimeoutError as exc:  # say why: the pod's status and the namespace's events
        status = cluster.get("pod", name, "-n", ns)["status"]
        events = cluster.kubectl("get", "events", "-n", ns, check=False).stdout
        raise TimeoutError(f"{exc}\nstatus: {status}\nevents:\n{events}") from None


def _logs(cluster: ControlPlane, ns: str, name: str) -> str:
    return cluster.kubectl("logs", "-n", ns, name).stdout


def test_a_real_pod_runs_its_command_and_succeeds(real_cluster: ControlPlane, real_namespace: str) -> None:
    ns = real_namespace
    script = "echo hello from $(hostname) in $(cat /var/run/secrets/kubernetes.io/serviceaccount/namespace)"
    real_cluster.apply(pod_manifest("hello", _busybox(real_cluster), ["sh", "-c", script]), namespace=ns)
    pod = _finished(real_cluster, ns, "hello")
    assert pod["status"]["phase"] == "Succeeded", pod["status"]
    assert real_cluster.node is not None
    assert pod["spec"]["nodeName"] == real_cluster.node.addr.node_name
    assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(
        real_cluster.node.addr.pod_cidr
    )
    # The log went container -> containerd -> kubelet -> apiserver (client cert) -> kubectl.
    assert _logs(real_cluster, ns, "hello").strip() == f"hello from hello in {ns}"


def test_a_failing_command_fails_the_pod_with_its_exit_code(
    real_cluster: ControlPlane, real_namespace: str
) -> None:
    ns = real_namespace
    real_cluster.apply(pod_manifest("fails", _busybox(real_cluster), ["sh", "-c", "exit 3"]), namespace=ns)
    pod = _finished(real_cluster, ns, "fails")
    assert pod["status"]["phase"] == "Failed"
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3


def test_a_pod_resolves_a_service_name_and_reaches_it(
    real_cluster: ControlPlane, real_namespace: str
) -> None:
    ns = real_namespace
    image = _busybox(real_cluster)
    server = pod_manifest(
        "web",
        image,
        ["sh", "-c", "mkdir -p /www && echo served-by-web > /www/index.html && httpd -f -p 8080 -h /www"],
    )
    server["metadata"]["labels"] = {"app": "web"}
    server["spec"]["containers"][0]["readinessProbe"] = {"tcpSocket": {"port": 8080}, "periodSeconds": 1}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    real_cluster.apply([server, service], namespace=ns)
    real_cluster.wait_for(
        lambda: real_cluster.get("endpointslices", "-n", ns, "-l", "kubernetes.io/service-name=web")["items"][
            0
        ]["endpoints"][0]["conditions"]["ready"],
        timeout=120,
        what="the web Service's endpoint ready",
    )
    # The name resolves through CoreDNS (busybox's nslookup: static binaries have no NSS resolver);
    # the ClusterIP it answers reaches the server through kube-proxy's rules (nc: Debian's static
    # busybox wget crashes).
    script = (
        f"nslookup web.{ns}.svc.cluster.local > /tmp/dns && cat /tmp/dns && "
        "ip=$(awk '/^Address: /{print $2}' /tmp/dns | tail -n1) && "
        r"printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 10 $ip 80"
    )
    client = pod_manifest("client", image, ["sh", "-c", script])
    real_cluster.apply(client, namespace=ns)
    pod = _finished(real_cluster, ns, "client")
    out = _logs(real_cluster, ns, "client")
    assert pod["status"]["phase"] == "Succeeded", out
    cluster_ip = real_cluster.get("service", "web", "-n", ns)["spec"]["clusterIP"]
    assert cluster_ip in out  # nslookup's answer
    assert out.strip().endswith("served-by-web")


def test_a_pod_reaches_the_apiserver_through_the_kubernetes_service(
    real_cluster: ControlPlane, real_namespace: str
) -> None:
    """$KUBERNETES_SERVICE_HOST:PORT (the `kubernetes` Service, which every in-cluster client uses)
    leads through kube-proxy to the apiserver on the veth; the TLS + token path is exercised by
    test_the_runtime_image_runs_lockstep_in_a_pod."""
    ns = real_namespace
    script = "nc -w 10 $KUBERNETES_SERVICE_HOST $KUBERNETES_SERVICE_PORT </dev/null && echo reachable"
    real_cluster.apply(pod_manifest("api", _busybox(real_cluster), ["sh", "-c", script]), namespace=ns)
    pod = _finished(real_cluster, ns, "api")
    out = _logs(real_cluster, ns, "api")
    assert pod["status"]["phase"] == "Succeeded", out
    assert out.strip() == "reachable"


def test_pods_without_the_toleration_stay_on_kwok_nodes(
    real_cluster: ControlPlane, real_namespace: str
) -> None:
    ns = real_namespace
    real_cluster.add_nodes(
        [NodePool(prefix="kwok-cpu", count=1, capacity={"cpu": "8", "memory": "32Gi", "pods": "110"})]
    )
    plain = pod_manifest("plain", _busybox(real_cluster), ["sleep", "1"])
    del plain["spec"]["nodeSelector"], plain["spec"]["tolerations"]
    real_cluster.apply(plain, namespace=ns)
    node = real_cluster.wait_for(
        lambda: real_cluster.get("pod", "plain", "-n", ns)["spec"].get("nodeName"),
        timeout=60,
        what="plain scheduled",
    )
    assert node == "kwok-cpu-0"
    real_node = real_cluster.get("node", "-l", f"{REAL_NODE_LABEL}=real")["items"]
    assert [n["spec"]["taints"][0]["key"] for n in real_node] == [REAL_NODE_LABEL]


def test_stop_leaves_no_process_mount_veth_cgroup_or_rule(tmp_path: Path, real_node_here: None) -> None:
    """A second, short-lived cluster with a real node (it takes the next slot) runs a pod under a
    NetworkPolicy (so kube-router makes its chains and ipsets), stops, and nothing of it is left on the
    host (stop() itself also raises on leftovers)."""
    sets_before = _host_ipsets()
    cp = ControlPlane(nodes_file=None, real_node=True)
    cp.start()
    try:
        assert cp.node is not None
        addr, work = cp.node.addr, cp.work_dir
        cp.kubectl("create", "namespace", "t")
        cp.wait_for(
            lambda: cp.kubectl("get", "sa", "default", "-n", "t", check=False).returncode == 0, timeout=30
        )
        pod = pod_manifest("p", cp.node.images["busybox"], ["sleep", "3600"])
        pod["metadata"]["labels"] = {"app": "p"}
        policy = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "p"},
            "spec": {
                "podSelector": {"matchLabels": {"app": "p"}},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "p"}}}]}],
            },
        }
        cp.apply([policy, pod], namespace="t")
        cp.wait_for(
            lambda: cp.get("pod", "p", "-n", "t")["status"].get("phase") == "Running",
            timeout=120,
            what="p Running",
        )
        node = cp.node
        cp.wait_for(
            lambda: "KUBE-POD-FW-" in node.iptables_rules() and "KUBE-SRC-" in node.ipsets(),
            timeout=60,
            what="kube-router's chain and ipset for p",
        )
    finally:
        cp.stop()
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(work) not in mounts
    assert not Path(f"/sys/class/net/{addr.host_veth}").exists()
    assert not any(Path("/sys/fs/cgroup").glob(f"*/{addr.cgroup_root.lstrip('/')}"))
    assert not [s for s in _host_ipsets() - sets_before if s.startswith("KUBE-")]
    host_rules = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout
    assert "KUBE-ROUTER" not in host_rules and "KUBE-POD-FW" not in host_rules


def _host_ipsets() -> set[str]:
    return set(
        subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True, check=True).stdout.split()
    )


@pytest.mark.timeout(2400)  # cold: Debian rootfs, a 5 GiB layer (CUDA torch from PyPI), its import
def test_the_runtime_image_runs_lockstep_in_a_pod(real_cluster: ControlPlane, real_namespace: str) -> None:
    """The runtime image built here by images/runtime.Dockerfile's recipe (node/runtime_image.py) runs
    the CLI and imports torch and megatron-core (the default trainer backend) as user 1000; it is also
    in the node under its published reference, the operator's default."""
    assert real_cluster.node is not None
    image = real_cluster.node.runtime_image()
    # The in-cluster path of the driver's progress reports: the `kubernetes` Service, the apiserver's
    # certificate verified against the mounted CA, the projected ServiceAccount token.
    check_api = (
        "import os, ssl, urllib.request as u; d = '/var/run/secrets/kubernetes.io/serviceaccount'; "
        "url = 'https://%s:%s/version' % (os.environ['KUBERNETES_SERVICE_HOST'], os.environ['KUBERNETES_SERVICE_PORT']); "
        "req = u.Request(url, headers={'Authorization': 'Bearer ' + open(d + '/token').read()}); "
        "print(u.urlopen(req, context=ssl.create_default_context(cafile=d + '/ca.crt')).read().decode())"
    )
    script = (
        "id -u && python -c 'import torch, megatron.core, lockstep.cli; print(\"torch\", torch.__version__)' && "
        f'python -c "{check_api}" && lockstep --help'
    )
    real_cluster.apply(pod_manifest("rt", image, ["sh", "-c", script]), namespace=real_namespace)
    pod = _finished(real_cluster, real_namespace, "rt", timeout=600)
    out = _logs(real_cluster, real_namespace, "rt")
    assert pod["status"]["phase"] == "Succeeded", out
    lines = out.splitlines()
    assert lines[0] == "1000"
    # megatron-core warns on stderr (no Transformer Engine or Apex on CPU), interleaved in the log.
    assert any(line.startswith("torch 2.") for line in lines[1:]), out
    assert '"gitVersion": "v1.36.3"' in out
    assert "usage: lockstep" in out
    # The image's own entry command (no command in the pod: the image's CMD), under its release name.
    published = image_ref("runtime")
    assert published in real_cluster.node.ctr("images", "list", "--quiet").stdout.split()
    entry = pod_manifest("rt-cmd", published, [])
    del entry["spec"]["containers"][0]["command"]
    real_cluster.apply(entry, namespace=real_namespace)
    pod = _finished(real_cluster, real_namespace, "rt-cmd", timeout=300)
    assert pod["status"]["phase"] == "Succeeded", _logs(real_cluster, real_namespace, "rt-cmd")
    assert "usage: lockstep" in _logs(real_cluster, real_namespace, "rt-cmd")


@pytest.mark.timeout(1200)
def test_the_operator_image_starts_its_entry_in_a_pod(
    real_cluster: ControlPlane, real_namespace: str
) -> None:
    """The operator image (images/operator.Dockerfile's recipe) runs its own entry command,
    `lockstep-operator`, as user 65532 in a pod: it starts, reads its settings and reaches the
    apiserver with the pod's ServiceAccount (which may not list the CRDs: kopf says so and keeps
    running, as a Deployment's pod does until its RBAC is applied)."""
    assert real_cluster.node is not None
    image = real_cluster.node.operator_image()
    assert image_ref("operator") in real_cluster.node.ctr("images", "list", "--quiet").stdout.split()
    ns = real_namespace
    check = "id -u && python -c \"import lockstep_operator.handlers, sys; assert 'torch' not in sys.modules; print('no torch')\""
    real_cluster.apply(pod_manifest("op-check", image, ["sh", "-c", check]), namespace=ns)
    pod = _finished(real_cluster, ns, "op-check", timeout=300)
    out = _logs(real_cluster, ns, "op-check")
    assert pod["status"]["phase"] == "Succeeded", out
    assert out.split() == ["65532", "no", "torch"]
    env = [
        {"name": "LOCKSTEP_OPERATOR_HA_MODE", "value": "standalone"},
        {"name": "LOCKSTEP_OPERATOR_HEALTH_PORT", "value": "8080"},
        {"name": "LOCKSTEP_OPERATOR_METRICS_PORT", "value": "0"},
    ]
    entry = pod_manifest("op", image_ref("operator"), [])
    del entry["spec"]["containers"][0]["command"]  # the image's CMD
    entry["spec"]["containers"][0]["env"] = env
    real_cluster.apply(entry, namespace=ns)

    def started() -> str | None:
        out = real_cluster.kubectl("logs", "-n", ns, "op", check=False).stdout
        return out if '"message"' in out else None

    out = real_cluster.wait_for(started, timeout=300, what="the operator's first log line")
    assert real_cluster.get("pod", "op", "-n", ns)["status"]["phase"] == "Running", out
    assert real_cluster.get("pod", "op", "-n", ns)["status"]["containerStatuses"][0]["restartCount"] == 0


# ------------------------------------------------------------------ NetworkPolicy (kube-router enforces)
NP_JOB = "np"
NP_OTHER_PORT = 29700
"""A port the OS would pick for NCCL, gloo or Mooncake on a rank or engine pod."""


def _np_server(name: str, image: str, labels: dict[str, str], ports: list[int]) -> dict[str, Any]:
    """A busybox pod listening on `ports` (httpd), Ready through a kubelet TCP probe on the first: the
    kubelet's probes must pass the pod's policy."""
    daemons = " && ".join(f"httpd -p {p} -h /www" for p in ports[1:])
    script = f"mkdir -p /www && echo ok > /www/index.html && {daemons + ' && ' if daemons else ''}httpd -f -p {ports[0]} -h /www"
    pod = pod_manifest(name, image, ["sh", "-c", script])
    pod["metadata"]["labels"] = labels
    pod["spec"]["containers"][0]["readinessProbe"] = {"tcpSocket": {"port": ports[0]}, "periodSeconds": 1}
    return pod


def _np_client(
    name: str, image: str, labels: dict[str, str], targets: list[tuple[str, str, int, bool]]
) -> dict[str, Any]:
    """A pod that connects to each (name, ip, port, expected open) target and prints `name:port
    open|closed`. Targets expected open are tried up to 30 times a second apart (the enforcer adds a
    new pod to its peers' allow-sets a moment after the pod starts, as Calico and Cilium do); the
    others are tried once, after the open ones (the test waits for the servers' firewall chains first)."""
    lines = [
        "try() { i=0; while [ $i -lt $3 ]; do nc -w 3 $1 $2 </dev/null >/dev/null 2>&1 && return 0; i=$((i+1)); sleep 1; done; return 1; }"
    ]
    for tname, ip, port, want_open in sorted(targets, key=lambda t: not t[3]):
        tries = 30 if want_open else 1
        lines.append(
            f'if try {ip} {port} {tries}; then echo "{tname}:{port} open"; else echo "{tname}:{port} closed"; fi'
        )
    pod = pod_manifest(name, image, ["sh", "-c", "\n".join(lines)])
    pod["metadata"]["labels"] = labels
    return pod


def test_network_policy_lets_only_the_allowed_peers_connect(
    real_cluster: ControlPlane, real_namespace: str
) -> None:
    """The operator's own NetworkPolicies (resources.network), enforced on the real node by kube-router:
    the driver alone reaches rank 0's control port; ranks and the pool's engines reach the other rank
    ports; the engine port from the driver and the ranks; nothing reaches the driver; a pod of the
    job without a role, and a pod in another namespace carrying the driver's labels, reach nothing.
    An engine of a job whose own policies do not exist yet (pods come before them) answers only on its
    metrics port: the namespace's baseline closes it. Fails where nothing enforces NetworkPolicy (the
    intruders connect) and where a policy is too tight."""
    from lockstep_operator.resources.common import (
        CONTROL_PORT,
        ENGINE_PORT,
        METRICS_PORT,
        RENDEZVOUS_PORT,
        Owner,
        pool_name,
        trainer_name,
    )
    from lockstep_operator.resources.network import (
        baseline_network_policy,
        driver_network_policy,
        engine_network_policy,
        trainer_network_policy,
    )
    from lockstep_operator.resources.pods import selector_labels

    assert real_cluster.node is not None
    ns, image, job = real_namespace, _busybox(real_cluster), NP_JOB
    trainer, pool = trainer_name(job), pool_name(job)
    # A real owner, so that the garbage collector keeps the policies.
    real_cluster.kubectl("create", "configmap", "np-owner", "-n", ns)
    owner_cm = real_cluster.get("configmap", "np-owner", "-n", ns)
    owner = Owner(
        api_version="v1", kind="ConfigMap", name="np-owner", uid=owner_cm["metadata"]["uid"], namespace=ns
    )
    real_cluster.apply(
        [
            trainer_network_policy(owner, job=job, trainer=trainer, pool=pool),
            engine_network_policy(owner, job=job, pool=pool, trainer=trainer),
            driver_network_policy(owner, job=job),
            baseline_network_policy(ns),
        ]
    )
    rank_labels = selector_labels(job, trainer=trainer)
    engine_labels = selector_labels(job, pool=pool)
    driver_labels = selector_labels(job, driver=True)
    real_cluster.apply(
        [
            _np_server("rank0", image, rank_labels, [RENDEZVOUS_PORT, CONTROL_PORT, NP_OTHER_PORT]),
            _np_server("engine", image, engine_labels, [ENGINE_PORT, NP_OTHER_PORT]),
            _np_server("driver", image, driver_labels, [8080]),
            _np_server(
                "early",
                image,
                selector_labels("np-early", pool="np-early-rollout"),
                [ENGINE_PORT, METRICS_PORT],
            ),
        ],
        namespace=ns,
    )

    def ready_ips() -> dict[str, str] | None:
        items = real_cluster.get("pods", "-n", ns)["items"]
        ips = {
            p["metadata"]["name"]: p["status"]["podIP"]
            for p in items
            if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        }
        return ips if {"rank0", "engine", "driver", "early"} <= ips.keys() else None

    ips = real_cluster.wait_for(ready_ips, timeout=120, what="the four servers Ready (kubelet probes pass)")
    node = real_cluster.node
    real_cluster.wait_for(
        lambda: all(
            any(f"{ip}/32" in r and "KUBE-POD-FW-" in r for r in node.iptables_rules().splitlines())
            for ip in ips.values()
        ),
        timeout=60,
        what="kube-router's firewall chains for the four servers",
    )
    rank0, engine, driver, early = ips["rank0"], ips["engine"], ips["driver"], ips["early"]
    expected = {
        "as-driver": [
            ("rank0", rank0, CONTROL_PORT, True), ("engine", engine, ENGINE_PORT, True),
            ("rank0", rank0, RENDEZVOUS_PORT, False), ("engine", engine, NP_OTHER_PORT, False),
        ],
        "as-rank": [
            ("rank0", rank0, RENDEZVOUS_PORT, True), ("rank0", rank0, NP_OTHER_PORT, True),
            ("engine", engine, ENGINE_PORT, True), ("engine", engine, NP_OTHER_PORT, True),
            ("rank0", rank0, CONTROL_PORT, False), ("driver", driver, 8080, False),
            ("early", early, METRICS_PORT, True), ("early", early, ENGINE_PORT, False),
        ],
        "as-engine": [
            ("rank0", rank0, NP_OTHER_PORT, True), ("engine", engine, NP_OTHER_PORT, True),
            ("rank0", rank0, CONTROL_PORT, False), ("driver", driver, 8080, False),
        ],
        "intruder": [
            ("rank0", rank0, CONTROL_PORT, False), ("rank0", rank0, RENDEZVOUS_PORT, False),
            ("engine", engine, ENGINE_PORT, False), ("engine", engine, NP_OTHER_PORT, False),
            ("driver", driver, 8080, False),
            ("early", early, METRICS_PORT, True), ("early", early, ENGINE_PORT, False),
        ],
    }  # fmt: skip
    labels = {
        "as-driver": driver_labels,
        "as-rank": rank_labels,
        "as-engine": engine_labels,
        "intruder": {"rl.lockstep.dev/job": job},
    }
    real_cluster.apply([_np_client(n, image, labels[n], t) for n, t in expected.items()], namespace=ns)
    # Another namespace, the driver's labels: a podSelector without a namespaceSelector is this namespace only.
    other = f"{ns}-x"
    real_cluster.kubectl("create", "namespace", other)
    try:
        real_cluster.wait_for(
            lambda: (
                real_cluster.kubectl("get", "serviceaccount", "default", "-n", other, check=False).returncode
                == 0
            ),
            timeout=30,
            what=f"ServiceAccount default in {other}",
        )
        outsider = [("rank0", rank0, CONTROL_PORT, False), ("engine", engine, ENGINE_PORT, False)]
        real_cluster.apply(_np_client("outsider", image, driver_labels, outsider), namespace=other)
        got, want = {}, {}
        for name, targets in [*expected.items(), ("outsider", outsider)]:
            where = other if name == "outsider" else ns
            pod = _finished(real_cluster, where, name)
            out = _logs(real_cluster, where, name)
            assert pod["status"]["phase"] == "Succeeded", f"{name}: {pod['status']}\n{out}"
            got[name] = sorted(out.splitlines())
            want[name] = sorted(f"{t}:{p} {'open' if o else 'closed'}" for t, _, p, o in targets)
        assert got == want
    finally:
        real_cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
