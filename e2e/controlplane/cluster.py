"""A real, local Kubernetes control plane for the e2e tests and for people.

Why: the operator is tested against the real thing — schema and CEL rejection, status and scale
subresources, garbage collection, scheduling onto GPU nodes — not a mock. `ControlPlane` starts etcd,
kube-apiserver (token auth + RBAC), kube-controller-manager, kube-scheduler and kwok (which plays the
kubelets of simulated GPU nodes) from the binaries that build.sh compiles, all on 127.0.0.1 with free
ports and all state under one temp dir, and stops them leaving no process and no listening port.

Who calls it: e2e/conftest.py (the session fixture `cluster`), bench/controlplane_start.py, and
`python -m e2e.controlplane start|stop|status` (start.sh / stop.sh) for people.
Only the stdlib, pyyaml and the `openssl` CLI (for the service-account RSA key) are used.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from e2e.controlplane import ports as portutil

if TYPE_CHECKING:
    from e2e.controlplane.nodes import NodePool
    from e2e.controlplane.realnode import RealNode

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build.sh"
STAGES_DIR = HERE / "stages"
DEFAULT_NODES = HERE.parent / "nodes.yaml"

T = TypeVar("T")

# Start order; stop goes in reverse so that clients die before the servers they talk to.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
SANDBOX_CONTROLLER = "agent-sandbox-controller"
"""kubernetes-sigs/agent-sandbox's controller (with its extensions), started with sandboxes=True."""

# Every default controller runs, as in a real cluster. node-lifecycle is the one that lifts the
# node.kubernetes.io/not-ready taint (added at creation) once kwok reports Ready; its grace period is
# raised from 50 s so that a loaded 2-core CI machine delaying kwok's lease renewals cannot mark nodes
# unhealthy and evict pods in the middle of a test.
KCM_CONTROLLERS = "*"
NODE_MONITOR_GRACE = "180s"
SERVICE_CIDR = "10.96.0.0/16"
START_ATTEMPTS = 3  # a start that lost a port race to another process is retried on new ports
POD_CIDR = "10.244.0.1/16"  # kwok hands out pod IPs from here; they are data only, never routed


class ControlPlaneError(RuntimeError):
    """A component failed to start or to stop; the message names it and points at its log."""


def find_binaries(build: bool = True) -> Path:
    """The directory holding the built binaries: $LOCKSTEP_CONTROLPLANE_BIN, else build.sh's output.

    build.sh only compiles what is missing from its versioned cache and prints the bin dir last, so
    calling it when everything is cached costs a few milliseconds and needs no Go toolchain.
    """
    env = os.environ.get("LOCKSTEP_CONTROLPLANE_BIN")
    if env:
        path = Path(env)
        missing = [c for c in (*COMPONENTS, "kubectl") if not (path / c).exists()]
        if missing:
            raise ControlPlaneError(
                f"LOCKSTEP_CONTROLPLANE_BIN={path} lacks {missing}; unset it to build with {BUILD_SCRIPT}"
            )
        return path
    if not build:
        raise ControlPlaneError("no binaries: run `bash e2e/controlplane/build.sh` (make controlplane)")
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ControlPlaneError(f"{BUILD_SCRIPT} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


@dataclass(slots=True)
class Ports:
    """The loopback TCP ports one control plane listens on (all picked free at start)."""

    etcd_client: int
    """etcd's client URL port (the apiserver is its only client)."""
    etcd_peer: int
    """etcd's peer port (a single member, but etcd always listens for peers)."""
    apiserver: int
    """kube-apiserver's secure port: the API URL is https://127.0.0.1:<apiserver>."""
    controller_manager: int
    """kube-controller-manager's secure port (serves /healthz)."""
    scheduler: int
    """kube-scheduler's secure port (serves /healthz)."""

    def all(self) -> list[int]:
        return [self.etcd_client, self.etcd_peer, self.apiserver, self.controller_manager, self.scheduler]


@dataclass
class ControlPlane:
    """One running local control plane. Use as a context manager, or call start() and stop().

    After start(): `kubeconfig` (admin token, CA-verified TLS), `api_url`, `admin_token` are set; the
    nodes of `nodes_file` exist and are Ready (kwok manages them). kubectl/apply/wait_for are helpers
    for tests; add_nodes() (e2e/controlplane/nodes.py) adds more simulated nodes.
    """

    bin_dir: Path | None = None
    """Where the binaries are; None: find_binaries() (builds what is missing)."""
    work_dir: Path | None = None
    """All state (etcd data, certs, keys, kubeconfig, logs); None: a fresh temp dir, removed by stop()."""
    nodes_file: Path | None = DEFAULT_NODES
    """The simulated nodes created at start (e2e/nodes.yaml); None: no nodes."""
    start_timeout: float = 120.0
    """Seconds to wait for each readiness step before failing with the component's log tail."""
    keep_work_dir: bool = False
    """Keep work_dir after stop() (for debugging: the logs are under work_dir/logs)."""
    die_with_parent: bool = True
    """Components get SIGKILL if the starting process dies (a killed pytest leaks nothing); start.sh
    sets False so that they outlive it. Linux ties this to the *thread* that called start(): start
    from a thread that lives as long as the control plane (the main thread), or set False."""

    real_node: bool = False
    """Also run one real worker node (kubelet, containerd, kube-proxy, CoreDNS; e2e/controlplane/
    realnode.py) next to the kwok nodes. Needs root; the apiserver then listens on the node's veth
    address (10.86.<slot>.1) instead of 127.0.0.1, so that pods reach it."""
    sandboxes: bool = False
    """Also install kubernetes-sigs/agent-sandbox (CRDs and controller; docs/sandbox.md)."""

    clock: Callable[[], float] = time.monotonic
    """Monotonic clock (seconds) for timeouts and `milestones`; injected for tests of the timings."""

    milestones: dict[str, float] = field(default_factory=dict, init=False)
    """Seconds from start() to: etcd, apiserver (/readyz), controllers (kcm + scheduler healthy, the
    default ServiceAccount made), nodes (all Ready and schedulable), ready (start() returns)."""
    ports: Ports | None = field(default=None, init=False)
    """The ports in use once started."""
    admin_token: str = field(default="", init=False, repr=False)
    """The bearer token of user `admin` (group system:masters). Never logged."""
    pids: dict[str, int] = field(default_factory=dict, init=False)
    """Component name -> pid; each component leads its own process group (pgid == pid)."""
    _t0: float = field(default=0.0, init=False, repr=False)
    _owns_work_dir: bool = field(default=False, init=False)
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, init=False, repr=False)
    node: RealNode | None = field(default=None, init=False, repr=False)
    """The real node when real_node=True (its .addr, .images, .ctr(), milestones)."""

    # ------------------------------------------------------------------ paths and addresses
    @property
    def api_url(self) -> str:
        """https://127.0.0.1:<port> of the apiserver."""
        if self.ports is None:
            raise ControlPlaneError("not started: call start() first")
        return f"https://{self.api_host}:{self.ports.apiserver}"

    @property
    def api_host(self) -> str:
        """The apiserver's address: 127.0.0.1, or the real node's veth host address."""
        return self.node.addr.host_ip if self.node is not None else "127.0.0.1"

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (token auth, the apiserver's self-signed CA)."""
        return self._dir / "kubeconfig"

    @property
    def ca_file(self) -> Path:
        """The apiserver's serving certificate chain, written by the apiserver into its cert dir."""
        return self._dir / "apiserver-certs" / "apiserver.crt"

    @property
    def log_dir(self) -> Path:
        return self._dir / "logs"

    @property
    def _dir(self) -> Path:
        if self.work_dir is None:
            raise ControlPlaneError("not started: call start() first")
        return self.work_dir

    def _bin(self, name: str) -> str:
        assert self.bin_dir is not None
        return str(self.bin_dir / name)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        """Start every component in order and wait until all are ready; on failure stop what started.

        Ports are picked free just before use, so another process on the machine may take one first;
        a start that fails with "address already in use" is retried on new ports (in a new temp dir).
        """
        if self.bin_dir is None:
            self.bin_dir = find_binaries()
        fresh_dir = self.work_dir is None
        for attempt in range(START_ATTEMPTS):
            if fresh_dir:
                self.work_dir = Path(tempfile.mkdtemp(prefix="lockstep-cp-"))
                self._owns_work_dir = True
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.milestones.clear()
            self._t0 = self.clock()
            try:
                self._start_all()
                self._mark("ready")
                return self
            except ControlPlaneError as exc:
                self.stop(check=False)
                if not (fresh_dir and "address already in use" in str(exc)) or attempt + 1 == START_ATTEMPTS:
                    raise
            except BaseException:
                self.stop(check=False)
                raise
        raise AssertionError("unreachable")

    def _start_all(self) -> None:
        ports = self.ports = Ports(*portutil.free_ports(5))
        if self.real_node:
            from e2e.controlplane.realnode import RealNode

            self.node = RealNode(work_dir=self._dir / "node", die_with_parent=self.die_with_parent)
            self.node.prepare()  # the veth whose host address the apiserver binds
        self._spawn("etcd", self._etcd_args())
        self._write_credentials()  # the RSA key is made while etcd starts
        self._wait(lambda: self._http_ok(f"http://127.0.0.1:{ports.etcd_client}/health"), "etcd", "/health")
        self._mark("etcd")
        self._spawn("kube-apiserver", self._apiserver_args())
        self._wait(self.ca_file.exists, "kube-apiserver", "its self-signed certificate")
        self._write_kubeconfig()
        self._wait(lambda: self._api_ok("/readyz"), "kube-apiserver", "/readyz")
        self._mark("apiserver")
        self._spawn("kube-controller-manager", self._controller_manager_args())
        self._spawn("kube-scheduler", self._scheduler_args())
        self._spawn("kwok", self._kwok_args())
        node_names: list[str] = []
        if self.nodes_file is not None:
            from e2e.controlplane.nodes import create_nodes, load_pools

            # Created while the controllers start: kwok picks them up as soon as it watches.
            node_names = create_nodes(self, load_pools(self.nodes_file))
        self._wait_components_ready(node_names)
        if self.node is not None:
            self.node.start(self)
            self._mark("real node")
        if self.sandboxes:
            self.start_sandboxes()

    def start_sandboxes(self) -> None:
        """Install agent-sandbox's CRDs and start its controller (Sandbox, SandboxTemplate,
        SandboxWarmPool, SandboxClaim), built by build.sh from the pinned module; no ports of its own
        (metrics and probes off), one instance (no leader election)."""
        crds = str(Path(self._bin("agent-sandbox-crds")).resolve())  # kubectl reads a linked dir as a file
        self.kubectl("apply", "--server-side", "-f", crds)
        self.kubectl("wait", "--for=condition=Established", "-f", crds, "--timeout=60s")
        self._spawn_sandbox_controller(())
        self._mark("sandboxes")

    def restart_sandbox_controller(self, flags: Sequence[str]) -> None:
        """Start agent-sandbox's controller again with `flags` added (a bench compares its settings in
        one run); the objects it manages stay."""
        pid = self.pids.pop(SANDBOX_CONTROLLER, None)
        if pid is not None:
            _kill_group(pid, self._procs.pop(SANDBOX_CONTROLLER, None))
        self._spawn_sandbox_controller(flags)

    def _spawn_sandbox_controller(self, flags: Sequence[str]) -> None:
        self._spawn(
            SANDBOX_CONTROLLER,
            [
                self._bin(SANDBOX_CONTROLLER),
                f"--kubeconfig={self.kubeconfig}",
                "--extensions",
                "--leader-elect=false",
                "--metrics-bind-address=0",
                "--health-probe-bind-address=0",
                *flags,
            ],
        )

    def _wait_components_ready(self, node_names: list[str]) -> None:
        assert self.ports is not None
        kcm, sched = self.ports.controller_manager, self.ports.scheduler
        self._wait(
            lambda: self._http_ok(f"https://127.0.0.1:{kcm}/healthz"), "kube-controller-manager", "/healthz"
        )
        self._wait(lambda: self._http_ok(f"https://127.0.0.1:{sched}/healthz"), "kube-scheduler", "/healthz")
        # The default ServiceAccount proves the serviceaccount controller runs (pods need it to admit).
        self._wait(
            lambda: self._api_ok("/api/v1/namespaces/default/serviceaccounts/default"),
            "kube-controller-manager",
            "the `default` ServiceAccount",
        )
        self._mark("controllers")
        if node_names:
            from e2e.controlplane.nodes import wait_nodes_ready

            wait_nodes_ready(self, node_names, timeout=self.start_timeout)
        self._mark("nodes")

    def _mark(self, milestone: str) -> None:
        self.milestones[milestone] = self.clock() - self._t0

    def stop(self, check: bool = True) -> None:
        """Kill every process group started (TERM, then KILL), then verify nothing is left.

        check=True raises ControlPlaneError if a process or a listening port survived.
        """
        node_left = ""
        if self.node is not None:
            if "kubelet" in self.node.milestones:
                self.node.drain(self)  # while the apiserver still answers
            try:
                self.node.stop(check=check)
            except ControlPlaneError as exc:
                node_left = str(exc)
        for name in (SANDBOX_CONTROLLER, *reversed(COMPONENTS)):
            pid = self.pids.get(name)
            if pid is not None:
                _kill_group(pid, self._procs.get(name))
        leftovers = [f"{n} (pid {p})" for n, p in self.pids.items() if _group_alive(p)]
        listening = portutil.listening(self.ports.all()) if self.ports else []
        self.pids.clear()
        self._procs.clear()
        if self._owns_work_dir and not self.keep_work_dir and self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        self.node = None
        if check and (leftovers or listening or node_left):
            raise ControlPlaneError(
                f"stop left processes {leftovers} and listening ports {listening} {node_left}".strip()
            )

    # ------------------------------------------------------------------ files
    def _write_credentials(self) -> None:
        self.admin_token = secrets.token_hex(24)
        node_tokens = self.node.token_lines() if self.node is not None else ""
        (self._dir / "tokens.csv").write_text(
            f'{self.admin_token},admin,admin,"system:masters"\n{node_tokens}'
        )
        os.chmod(self._dir / "tokens.csv", 0o600)
        key = self._dir / "sa.key"
        # One RSA key signs (private) and verifies (public) ServiceAccount tokens.
        subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
        subprocess.run(
            ["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(self._dir / "sa.pub")],
            check=True,
            capture_output=True,
        )

    def _write_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "lockstep-e2e",
                    "cluster": {"server": self.api_url, "certificate-authority": str(self.ca_file)},
                }
            ],
            "users": [{"name": "admin", "user": {"token": self.admin_token}}],
            "contexts": [
                {
                    "name": "lockstep-e2e",
                    "context": {"cluster": "lockstep-e2e", "user": "admin", "namespace": "default"},
                }
            ],
            "current-context": "lockstep-e2e",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))
        os.chmod(self.kubeconfig, 0o600)

    # ------------------------------------------------------------------ command lines
    def _etcd_args(self) -> list[str]:
        assert self.ports is not None
        client = f"http://127.0.0.1:{self.ports.etcd_client}"
        peer = f"http://127.0.0.1:{self.ports.etcd_peer}"
        return [
            self._bin("etcd"),
            f"--data-dir={self._dir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--unsafe-no-fsync",  # test data: durability is not wanted, speed is
            "--log-level=warn",
        ]

    def _apiserver_args(self) -> list[str]:
        assert self.ports is not None
        return [
            self._bin("kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.ports.etcd_client}",
            f"--bind-address={self.api_host}",
            f"--secure-port={self.ports.apiserver}",
            # Loopback advertise address needs the `none` reconciler (the lease one refuses loopback);
            # with a real node the `kubernetes` Service's endpoint is the veth address pods reach.
            f"--advertise-address={self.api_host}",
            *(["--endpoint-reconciler-type=none"] if self.node is None else self.node.apiserver_args()),
            f"--cert-dir={self._dir / 'apiserver-certs'}",
            f"--token-auth-file={self._dir / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={self._dir / 'sa.pub'}",
            f"--service-account-signing-key-file={self._dir / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            # on for a CPU profile of a bench (`kubectl get --raw /debug/pprof/profile?seconds=N`)
            f"--profiling={'true' if os.environ.get('LOCKSTEP_PROFILE_APISERVER') == '1' else 'false'}",
        ]

    def _controller_manager_args(self) -> list[str]:
        assert self.ports is not None
        return [
            self._bin("kube-controller-manager"),
            f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports.controller_manager}",
            f"--cert-dir={self._dir / 'kcm-certs'}",
            f"--controllers={KCM_CONTROLLERS}",
            f"--node-monitor-grace-period={NODE_MONITOR_GRACE}",
            # The default 20 QPS throttles the node-lifecycle controller lifting 27 taints at start.
            "--kube-api-qps=200",
            "--kube-api-burst=400",
            f"--service-account-private-key-file={self._dir / 'sa.key'}",
            f"--root-ca-file={self.ca_file}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--profiling=false",
        ]

    def _scheduler_args(self) -> list[str]:
        assert self.ports is not None
        return [
            self._bin("kube-scheduler"),
            f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports.scheduler}",
            f"--cert-dir={self._dir / 'scheduler-certs'}",
            "--profiling=false",
        ]

    def _kwok_args(self) -> list[str]:
        stages = sorted(STAGES_DIR.glob("*.yaml"))
        if not stages:
            raise ControlPlaneError(f"no kwok stages under {STAGES_DIR}")
        return [
            self._bin("kwok"),
            f"--kubeconfig={self.kubeconfig}",
            # With a real node, kwok must leave it (and its pods) to the kubelet.
            "--manage-all-nodes=true"
            if self.node is None
            else "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--node-ip=127.0.0.1",
            f"--cidr={POD_CIDR}",
            *[f"--config={s}" for s in stages],
        ]

    # ------------------------------------------------------------------ processes and probes
    def _spawn(self, name: str, args: list[str]) -> None:
        log = (self.log_dir / f"{name}.log").open("ab")
        env = dict(os.environ)
        # kwok reads ~/.kwok/kwok.yaml when present; a private HOME keeps the run hermetic.
        env["HOME"] = str(self._dir)
        with log:
            proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_kill_when_parent_dies if self.die_with_parent else None,
            )
        self._procs[name] = proc
        self.pids[name] = proc.pid

    def _wait(self, probe: Callable[[], bool], name: str, what: str) -> None:
        deadline = self.clock() + self.start_timeout
        while self.clock() < deadline:
            proc = self._procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise ControlPlaneError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            if probe():
                return
            time.sleep(0.1)
        raise ControlPlaneError(
            f"{name}: {what} not ready after {self.start_timeout:.0f} s; log tail:\n{self.log_tail(name)}"
        )

    def log_tail(self, name: str, lines: int = 40) -> str:
        """The last lines of a component's log (logs carry no tokens: only the token file path is passed)."""
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def _ssl_context(self) -> ssl.SSLContext:
        if self.ca_file.exists():
            return ssl.create_default_context(cafile=str(self.ca_file))
        return ssl.create_default_context()

    def _http_ok(self, url: str) -> bool:
        """GET url answers 200. The kcm/scheduler serve self-signed certs from their own CAs: unverified."""
        ctx = ssl._create_unverified_context() if url.startswith("https") else None
        try:
            with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def _api_ok(self, path: str) -> bool:
        try:
            self.api_get(path)
        except (OSError, urllib.error.URLError):
            return False
        return True

    def api_get(self, path: str) -> Any:
        """GET an API path as admin; JSON decoded (or text for /readyz-like endpoints)."""
        return self.api_request("GET", path)

    def api_request(self, method: str, path: str, body: Any = None) -> Any:
        """One API call as admin (JSON body); raises urllib.error.HTTPError on a non-2xx answer."""
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.api_url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=10, context=self._ssl_context()) as resp:
            text = resp.read().decode()
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(text)
        return text

    # ------------------------------------------------------------------ test helpers
    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl against this cluster; check=True raises with stderr on a non-zero exit."""
        # --cache-dir: discovery cache in the work dir, not one ~/.kube/cache entry per run's port.
        cmd = [
            self._bin("kubectl"),
            f"--kubeconfig={self.kubeconfig}",
            f"--cache-dir={self._dir / 'kubectl-cache'}",
            *args,
        ]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise ControlPlaneError(
                f"kubectl {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr}"
            )
        return proc

    def get(self, *args: str) -> Any:
        """`kubectl get <args> -o json`, decoded."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(
        self,
        manifest: str | dict[str, Any] | Sequence[dict[str, Any]],
        namespace: str | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Server-side apply a YAML text, one object or a list of objects (no size limit on CRDs);
        check=False returns a refused apply's process (its stderr carries the apiserver's reason)."""
        if isinstance(manifest, str):
            text = manifest
        elif isinstance(manifest, dict):
            text = yaml.safe_dump(manifest)
        else:
            text = yaml.safe_dump_all(list(manifest))
        ns = [f"--namespace={namespace}"] if namespace else []
        return self.kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=e2e",
            *ns,
            "-f",
            "-",
            input=text,
            check=check,
        )

    def add_nodes(self, pools: list[NodePool], timeout: float = 60.0) -> list[str]:
        """Create more simulated nodes (see e2e/nodes.yaml for the form) and wait until they are Ready."""
        from e2e.controlplane.nodes import add_nodes

        return add_nodes(self, pools, timeout=timeout)

    @staticmethod
    def wait_for(
        predicate: Callable[[], T], timeout: float = 30.0, what: str = "condition", interval: float = 0.2
    ) -> T:
        """Poll predicate until it returns a truthy value and return it; on timeout raise TimeoutError
        naming `what` with the last value or exception seen."""
        return wait_for(predicate, timeout=timeout, what=what, interval=interval)

    # ------------------------------------------------------------------ state for start.sh / stop.sh
    def save_state(self, path: Path) -> None:
        """Write what `stop` needs to find this control plane again from another process."""
        assert self.ports is not None
        state = {
            "work_dir": str(self._dir),
            "bin_dir": str(self.bin_dir),
            "pids": self.pids,
            "ports": self.ports.all(),
            "owns_work_dir": self._owns_work_dir,
            "node": self.node.to_state() if self.node is not None else None,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(state, indent=2))

    @classmethod
    def from_state(cls, path: Path) -> ControlPlane:
        """A handle on a control plane started by another process (save_state); stop() works on it."""
        state = json.loads(path.read_text())
        cp = cls(bin_dir=Path(state["bin_dir"]), work_dir=Path(state["work_dir"]), nodes_file=None)
        cp.ports = Ports(*state["ports"])
        cp.pids = {k: int(v) for k, v in state["pids"].items()}
        cp._owns_work_dir = bool(state["owns_work_dir"])
        if state.get("node"):
            from e2e.controlplane.realnode import RealNode

            cp.node = RealNode.from_state(state["node"])
        token_line = (cp._dir / "tokens.csv").read_text().split(",", 1)
        cp.admin_token = token_line[0]
        return cp


def wait_for(
    predicate: Callable[[], T], timeout: float = 30.0, what: str = "condition", interval: float = 0.2
) -> T:
    """Poll predicate until truthy; return its value. TimeoutError names `what` and the last result."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
            if value:
                return value
            last = value
        except Exception as exc:  # a transient NotFound while an object appears is normal: keep polling
            last = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}"[:2000])
        time.sleep(interval)


def _kill_when_parent_dies() -> None:
    """In the child before exec: ask Linux for SIGKILL when the parent exits (prctl PR_SET_PDEATHSIG).

    KILL, not TERM: all components get it at once, and an apiserver whose etcd is already gone hangs
    in its graceful shutdown."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 == PR_SET_PDEATHSIG


def _kill_group(pgid: int, proc: subprocess.Popen[bytes] | None, grace: float = 10.0) -> None:
    """SIGTERM the group, wait up to `grace` s, then SIGKILL; reap our child so no zombie is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _group_alive(pgid, proc) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _group_alive(pgid, proc):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        while _group_alive(pgid, proc):
            time.sleep(0.05)


def _group_alive(pgid: int, proc: subprocess.Popen[bytes] | None = None) -> bool:
    if proc is not None:
        proc.poll()  # reaps the leader if it exited (a zombie still counts as a group member)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _group_has_live_member(pgid)


def _group_has_live_member(pgid: int) -> bool:
    """killpg(0) succeeds on zombies too; look for a member of the group that is not a zombie."""
    return any(group == pgid and state != "Z" for _pid, state, group in _proc_stats())


def _proc_stats() -> Iterable[tuple[int, str, int]]:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # comm may contain spaces: fields after the last ')' are state, ppid, pgrp, ...
        rest = stat.rsplit(")", 1)[1].split()
        yield int(d.name), rest[0], int(rest[2])
