"""A real worker node of the local control plane: kubelet, containerd, runc, CNI, kube-proxy, CoreDNS,
and kube-router enforcing NetworkPolicy.

Why: kwok nodes run no process, so the pods the operator renders (commands, env, Service DNS, the
ServiceAccount token, volumes) never meet. This node runs them for real, next to the kwok GPU nodes.

Isolation, so that teardown leaves nothing: every node process lives in one private network
namespace *and* one private mount namespace, held open by a `holder` process (`unshare`). A veth pair
joins it to the host: the host end carries the apiserver's address (10.86.<slot>.1), the node end the
node's (10.86.<slot>.2); pods get 10.87.<slot>.0/24 on a bridge inside. iptables rules (kubelet's,
kube-proxy's, CNI's), routes, veths, pod network namespaces and every mount (overlay rootfs, volumes,
netns bind mounts) live in those namespaces and vanish with them; the kubelet's cgroups (under
/lockstep-node-<slot>) are removed at stop, and stop checks that nothing is left. The kubelet
"fixes" six kernel sysctls it wants (vm.overcommit_memory, kernel.panic, ...); in the private mount
namespace those /proc/sys files are bind-mounted read-only copies holding the values it wants, so the
shared host kernel is never changed. NetworkPolicy: the bridge CNI ignores it, so kube-router runs as a
firewall-only agent (iptables + ipset, both per network namespace: its chains and sets vanish with the
node's namespace too; stop checks the host has none). A slot (0..7, flock) lets several sessions each
run one node.

Images: no registry, so the sandbox (pause) image and a busybox test image are assembled here
(node/images.py) and imported into a containerd whose root persists per slot in the cache.
Called by e2e/controlplane/cluster.py (`ControlPlane(real_node=True)`). Needs root.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from e2e.controlplane.cluster import SERVICE_CIDR, ControlPlane, ControlPlaneError
from e2e.controlplane.node import images

HERE = Path(__file__).resolve().parent
NODE_BUILD = HERE / "node" / "build.sh"
CACHE = Path(os.environ.get("LOCKSTEP_CACHE", Path.home() / ".cache" / "lockstep"))
SLOTS = 8
CNI_BIN = Path("/usr/lib/cni")
LOCK_DIR = Path("/run/lock")

REAL_NODE_LABEL = "lockstep.dev/node"
"""Label (value `real`) and NoSchedule taint of the real node: pods that tolerate it and select it land
there; everything else (the GPU placement tests) keeps landing on kwok nodes."""
REAL_NODE_VALUE = "real"
CLUSTER_DOMAIN = "cluster.local"

# What the kubelet's setupKernelTunables wants; shown to it through read-only bind mounts (see above).
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}

# Host paths where containerd, runc, CNI and the kubelet keep state regardless of their flags (shim
# sockets, runc state, pod netns files, CNI results, the device-plugin socket): a private tmpfs each
# inside the node's mount namespace, so nothing lands on the host and two slots never share them.
PRIVATE_DIRS = ("/run/containerd", "/run/netns", "/var/lib/cni", "/var/lib/kubelet")

# Start order of the node's daemons; stop goes in reverse.
DAEMONS = ("containerd", "kubelet", "kube-proxy", "coredns", "kube-router")

KUBE_ROUTER_HEALTH_PORT = 20244
"""kube-router's /healthz, inside the node's network namespace (one per slot: no clash)."""
LEFTOVER_MARKERS = ("KUBE-", "CNI-", "lsnode", "10.86.", "10.87.", "kube-router")
"""Substrings of a host iptables rule or ipset name that only this node (kube-proxy, CNI, kube-router)
makes; any on the host after stop is a leftover."""


class RealNodeError(ControlPlaneError):
    """The real node could not start or left something behind; the message names what and the log."""


def find_node_binaries() -> Path:
    """The node's bin dir: $LOCKSTEP_NODE_BIN, else node/build.sh's output (builds what is missing)."""
    env = os.environ.get("LOCKSTEP_NODE_BIN")
    if env:
        return Path(env)
    proc = subprocess.run(["bash", str(NODE_BUILD)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RealNodeError(f"{NODE_BUILD} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


@dataclass(frozen=True, slots=True)
class Addresses:
    """The addresses of one slot (pure function of the slot number)."""

    slot: int

    @property
    def host_ip(self) -> str:
        """Host end of the veth: the apiserver binds and advertises this address."""
        return f"10.86.{self.slot}.1"

    @property
    def node_ip(self) -> str:
        """Node end of the veth: the kubelet's InternalIP."""
        return f"10.86.{self.slot}.2"

    @property
    def pod_cidr(self) -> str:
        return f"10.87.{self.slot}.0/24"

    @property
    def gateway(self) -> str:
        """The pod bridge's address; CoreDNS answers pods here (the kubelet's clusterDNS)."""
        return f"10.87.{self.slot}.1"

    @property
    def host_veth(self) -> str:
        return f"lsnode{self.slot}"

    @property
    def node_veth(self) -> str:
        return f"lsnode{self.slot}n"

    @property
    def node_name(self) -> str:
        return f"lockstep-real-{self.slot}"

    @property
    def cgroup_root(self) -> str:
        return f"/lockstep-node-{self.slot}"


@dataclass
class RealNode:
    """One real node. prepare() before the apiserver starts (it binds the veth's host address), then
    start(cluster) once the control plane is up; stop() tears down and checks nothing is left."""

    work_dir: Path
    """State of this run (configs, kubelet root, logs); removed with the control plane's work dir."""
    bin_dir: Path | None = None
    """The node binaries; None: find_node_binaries()."""
    start_timeout: float = 180.0
    die_with_parent: bool = True
    """As ControlPlane.die_with_parent: the node's processes get SIGKILL when the starting thread dies."""

    addr: Addresses = field(init=False)
    tokens: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    """user -> bearer token, added to the apiserver's token file (kubelet, kube-proxy, coredns)."""
    images: dict[str, str] = field(default_factory=dict, init=False)
    """Locally built image name (pause, busybox) -> reference in the node's containerd."""
    milestones: dict[str, float] = field(default_factory=dict, init=False)
    _lock: IO[bytes] | None = field(default=None, init=False, repr=False)
    _holder: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, init=False, repr=False)
    _ns: tuple[int, int] = field(default=(0, 0), init=False)
    _iptables_before: str = field(default="", init=False, repr=False)
    _ipsets_before: frozenset[str] = field(default=frozenset(), init=False, repr=False)
    _archives: dict[str, Path] = field(default_factory=dict, init=False, repr=False)
    _made_dirs: list[Path] = field(default_factory=list, init=False, repr=False)

    # ------------------------------------------------------------------ paths
    @property
    def containerd_root(self) -> Path:
        """Persistent per slot: imported images survive between runs."""
        return CACHE / "node" / f"containerd-{self.addr.slot}"

    @property
    def socket(self) -> Path:
        return self.work_dir / "containerd.sock"

    @property
    def log_dir(self) -> Path:
        return self.work_dir / "logs"

    def _bin(self, name: str) -> str:
        assert self.bin_dir is not None
        return str(self.bin_dir / name)

    # ------------------------------------------------------------------ phase 1: namespaces and veth
    def prepare(self) -> Addresses:
        """Take a slot, make the namespaces and the veth, write credentials. Returns the addresses."""
        if os.geteuid() != 0:
            raise RealNodeError("a real node needs root (network and mount namespaces, cgroups, containerd)")
        if self.bin_dir is None:
            self.bin_dir = find_node_binaries()
        self.addr = Addresses(self._take_slot())
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        _remove_cgroups(self.addr.cgroup_root)  # a killed earlier run of this slot
        self._iptables_before = _iptables_rules()
        self._ipsets_before = _ipsets()
        self._start_holder()
        self._setup_network()
        self._fake_sysctls()
        self._private_dirs()
        self.tokens = {
            f"system:node:{self.addr.node_name}": os.urandom(24).hex(),
            "system:kube-proxy": os.urandom(24).hex(),
            "lockstep:coredns": os.urandom(24).hex(),
            "lockstep:kube-router": os.urandom(24).hex(),
        }
        self._write_pki()
        return self.addr

    def _take_slot(self) -> int:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        for slot in range(SLOTS):
            f = (LOCK_DIR / f"lockstep-node-{slot}.lock").open("wb")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            self._lock = f
            return slot
        raise RealNodeError(f"all {SLOTS} real-node slots are taken (locks under {LOCK_DIR})")

    def _start_holder(self) -> None:
        # unshare: a new network and mount namespace (private propagation: nothing mounted inside
        # reaches the host), held by a sleeping process that dies with us.
        self._holder = subprocess.Popen(
            ["unshare", "--net", "--mount", "--propagation", "private", "sleep", "infinity"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # not the caller's: `$(start.sh)` waits for its stdout to close
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            # The holder inherits the slot's lock: the slot stays taken while the namespaces live,
            # also after a `start.sh` that started them has exited.
            pass_fds=(self._lock.fileno(),) if self._lock else (),
            preexec_fn=_kill_when_parent_dies if self.die_with_parent else None,
        )
        pid = self._holder.pid
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if os.stat(f"/proc/{pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino:
                break
            time.sleep(0.02)
        self._ns = (os.stat(f"/proc/{pid}/ns/net").st_ino, os.stat(f"/proc/{pid}/ns/mnt").st_ino)

    def nsenter(self, *args: str) -> list[str]:
        """The command line running args inside the node's network and mount namespaces."""
        assert self._holder is not None
        return ["nsenter", f"--target={self._holder.pid}", "--net", "--mount", "--", *args]

    def _run(self, *args: str, inside: bool = True) -> str:
        cmd = self.nsenter(*args) if inside else list(args)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RealNodeError(f"`{' '.join(args)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def _setup_network(self) -> None:
        a = self.addr
        assert self._holder is not None
        with contextlib.suppress(RealNodeError):  # left by a killed earlier run of this slot
            self._run("ip", "link", "del", a.host_veth, inside=False)
        self._run(
            "ip", "link", "add", a.host_veth, "type", "veth", "peer", "name", a.node_veth,
            "netns", str(self._holder.pid), inside=False,
        )  # fmt: skip
        self._run("ip", "addr", "add", f"{a.host_ip}/24", "dev", a.host_veth, inside=False)
        self._run("ip", "link", "set", a.host_veth, "up", inside=False)
        self._run("ip", "link", "set", "lo", "up")
        self._run("ip", "addr", "add", f"{a.node_ip}/24", "dev", a.node_veth)
        self._run("ip", "link", "set", a.node_veth, "up")
        self._run("ip", "route", "add", "default", "via", a.host_ip)
        # Replies from the host (the apiserver) to pods go back through the node.
        self._run("ip", "route", "add", a.pod_cidr, "via", a.node_ip, "dev", a.host_veth, inside=False)
        # Per network namespace: routing for pods, and bridged pod-to-pod Service traffic through
        # kube-proxy's rules (br_netfilter).
        self._run("sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        self._run("sh", "-c", "echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables")

    def _fake_sysctls(self) -> None:
        fake = self.work_dir / "sysctl"
        fake.mkdir(exist_ok=True)
        for key, value in KUBELET_SYSCTLS.items():
            path = fake / key.replace("/", ".")
            path.write_text(value + "\n")
            self._run("mount", "--bind", str(path), f"/proc/sys/{key}")
            self._run("mount", "-o", "remount,bind,ro", f"/proc/sys/{key}")

    def _private_dirs(self) -> None:
        for d in map(Path, PRIVATE_DIRS):
            if not d.exists():  # the mount point; removed again at stop
                d.mkdir(parents=True)
                self._made_dirs.append(d)
            self._run("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(d))

    def _write_pki(self) -> None:
        """A CA the kubelet trusts for client certificates, and the apiserver's client cert signed by it
        (group system:masters), so that `kubectl logs/exec` reach the kubelet authenticated."""
        pki = self.work_dir / "pki"
        pki.mkdir(exist_ok=True)

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=pki)

        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
                "-days", "2", "-subj", "/CN=lockstep-node-ca")  # fmt: skip
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver-kubelet.key",
                "-out", "apiserver-kubelet.csr", "-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client")  # fmt: skip
        openssl("x509", "-req", "-in", "apiserver-kubelet.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", "apiserver-kubelet.crt", "-days", "2")  # fmt: skip
        for key in pki.glob("*.key"):
            key.chmod(0o600)

    def token_lines(self) -> str:
        """Lines for the apiserver's token auth file (user, uid, groups)."""
        groups = {f"system:node:{self.addr.node_name}": "system:nodes"}
        return "".join(f'{tok},{user},{user},"{groups.get(user, "")}"\n' for user, tok in self.tokens.items())

    def apiserver_args(self) -> list[str]:
        pki = self.work_dir / "pki"
        return [
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet.key'}",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
        ]

    # ------------------------------------------------------------------ phase 2: daemons
    def start(self, cluster: ControlPlane) -> None:
        """Start containerd (and import the images), the kubelet, kube-proxy, CoreDNS and kube-router;
        wait until the node is Ready, DNS answers, kube-proxy is healthy and kube-router has hooked its
        NetworkPolicy chains into the node's filter table."""
        t0 = time.monotonic()
        self._apply_rbac(cluster)
        self._spawn("containerd", [self._bin_sys("containerd"), f"--config={self._containerd_config()}"])
        self._wait("containerd", lambda: self._ctr_ok())
        self._import_images()
        self.milestones["containerd"] = time.monotonic() - t0
        self._write_cni()
        _make_cgroups(self.addr.cgroup_root)  # the kubelet wants its cgroup root to exist
        self._spawn("kubelet", self._kubelet_args(cluster))
        self._spawn("kube-proxy", [self._bin("kube-proxy"), f"--config={self._kube_proxy_config(cluster)}"])
        self._spawn("coredns", [self._bin("coredns"), "-conf", str(self._corefile(cluster))])
        self._wait("kubelet", lambda: _node_ready(cluster, self.addr.node_name))
        self.milestones["kubelet"] = time.monotonic() - t0
        self._wait("kube-proxy", lambda: self._curl_ok("http://127.0.0.1:10256/healthz"))
        self._wait("coredns", lambda: self._curl_ok("http://127.0.0.1:8080/health"))
        self.milestones["ready"] = time.monotonic() - t0
        # kube-router reads the Node object at start (its InternalIP picks the local pods): after Ready.
        self._spawn("kube-router", self._kube_router_args(cluster))
        self._wait("kube-router", self._kube_router_ready)
        self.milestones["netpol"] = time.monotonic() - t0

    @staticmethod
    def _bin_sys(name: str) -> str:
        path = shutil.which(name)
        if path is None:
            raise RealNodeError(f"{name} is not installed: run `bash {HERE / 'node' / 'deps.sh'}` (as root)")
        return path

    def _apply_rbac(self, cluster: ControlPlane) -> None:
        """CoreDNS reads Services, EndpointSlices and Namespaces; kube-router (firewall only) reads the
        objects its informers watch; nothing else (least privilege)."""
        kube_router_reads = [
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
            {
                "apiGroups": [""],
                "resources": ["pods", "namespaces", "services", "endpoints"],
                "verbs": ["list", "watch"],
            },
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
            {
                "apiGroups": ["networking.k8s.io"],
                "resources": ["networkpolicies"],
                "verbs": ["list", "watch"],
            },
        ]
        cluster.apply(
            [
                *_cluster_role_for_user("lockstep:kube-router", kube_router_reads),
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "ClusterRole",
                    "metadata": {"name": "lockstep:coredns"},
                    "rules": [
                        {
                            "apiGroups": [""],
                            "resources": ["services", "namespaces"],
                            "verbs": ["list", "watch"],
                        },
                        {
                            "apiGroups": ["discovery.k8s.io"],
                            "resources": ["endpointslices"],
                            "verbs": ["list", "watch"],
                        },
                    ],
                },
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "ClusterRoleBinding",
                    "metadata": {"name": "lockstep:coredns"},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": "lockstep:coredns",
                    },
                    "subjects": [
                        {"kind": "User", "name": "lockstep:coredns", "apiGroup": "rbac.authorization.k8s.io"}
                    ],
                },
            ]
        )

    def _kubeconfig(self, cluster: ControlPlane, user: str) -> Path:
        path = self.work_dir / f"kubeconfig-{user.replace(':', '-')}"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "local",
                    "cluster": {"server": cluster.api_url, "certificate-authority": str(cluster.ca_file)},
                }
            ],
            "users": [{"name": user, "user": {"token": self.tokens[user]}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
            "current-context": "local",
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)
        return path

    def _containerd_config(self) -> Path:
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        text = f"""version = 2
root = "{self.containerd_root}"
state = "{self.work_dir / "containerd-state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[metrics]
  address = ""
[{cri}]
  sandbox_image = "{self.images_wanted()["pause"]}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_cdi = false
  # The kubelet asks for oom_score_adj -998 for sandboxes; lowering it needs CAP_SYS_RESOURCE, which
  # this machine's root lacks: clamp to containerd's own value instead of failing every pod.
  restrict_oom_score_adj = true
[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
[{cri}.cni]
  bin_dir = "{CNI_BIN}"
  conf_dir = "{self.work_dir / "cni"}"
  max_conf_num = 1
"""
        path = self.work_dir / "containerd.toml"
        path.write_text(text)
        return path

    def images_wanted(self) -> dict[str, str]:
        """name -> reference of the images this node imports (built into work_dir/images on first call)."""
        if not self.images:
            busybox = CACHE / "node" / "busybox" / "bin" / "busybox"
            for spec in (
                images.pause_image(Path(self._bin("pause")).resolve()),
                images.busybox_image(busybox),
            ):
                ref, path = images.build_archive(spec, self.work_dir / "images")
                self.images[spec.name] = ref
                self._archives[spec.name] = path
        return self.images

    def ctr(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """`ctr` on this node's containerd (namespace k8s.io, the CRI's)."""
        cmd = ["ctr", f"--address={self.socket}", "--namespace=k8s.io", *args]
        proc = subprocess.run(
            self.nsenter(*cmd), capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise RealNodeError(f"ctr {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc

    def _ctr_ok(self) -> bool:
        return self.socket.exists() and self.ctr("version", check=False, timeout=10).returncode == 0

    def import_image(self, ref: str, archive: Path) -> bool:
        """Import an OCI archive unless `ref` is already there; True if it was imported."""
        present = self.ctr("images", "list", "--quiet").stdout.split()
        if ref in present:
            return False
        self.ctr("images", "import", str(archive))
        if ref not in self.ctr("images", "list", "--quiet").stdout.split():
            raise RealNodeError(f"importing {archive} did not create image {ref}")
        return True

    def runtime_image(self) -> str:
        """The runtime image (images/runtime.Dockerfile's recipe, node/runtime_image.py); its ref."""
        return self.image("runtime")

    def operator_image(self) -> str:
        """The operator image (images/operator.Dockerfile's recipe, node/runtime_image.py); its ref."""
        return self.image("operator")

    def image(self, name: str) -> str:
        """Build (if its inputs changed) and import one of Lockstep's images for this node's
        architecture; its input-digest ref (lockstep.local/<name>:<digest>). The same image is also
        tagged with its published reference (ghcr.io/lockstep/lockstep-<name>:<version>), so the
        operator's default images run here as they would in a cluster pulling the release."""
        from lockstep.api.images import image_ref

        from e2e.controlplane.node.runtime_image import image_archive, local_ref

        if name not in self.images:
            ref = local_ref(name)
            if ref not in self.ctr("images", "list", "--quiet").stdout.split():
                have = frozenset(self.ctr("content", "list", "--quiet").stdout.split())
                ref, archive = image_archive(name, self.work_dir / "images", have=have)
                try:
                    self.import_image(ref, archive)
                finally:
                    archive.unlink(missing_ok=True)
                # Earlier builds hold gigabytes: keep only the current one in this containerd.
                old = [
                    r
                    for r in self.ctr("images", "list", "--quiet").stdout.split()
                    if r.startswith(f"lockstep.local/{name}:") and r != ref
                ]
                if old:
                    self.ctr("images", "remove", "--sync", *old)
            self.ctr("images", "tag", "--force", ref, image_ref(name))
            self._prune_image_ids()
            self.images[name] = ref
        return self.images[name]

    def _prune_image_ids(self) -> None:
        """Remove the CRI's `sha256:<config>` references of images no name points at any more (each
        keeps a removed image's gigabytes alive)."""
        rows = [line.split() for line in self.ctr("images", "list").stdout.splitlines()[1:]]
        keep = set()
        for row in rows:
            if len(row) > 2 and not row[0].startswith("sha256:"):
                manifest = json.loads(self.ctr("content", "get", row[2]).stdout)
                keep.add(manifest.get("config", {}).get("digest", ""))
        stale = [row[0] for row in rows if row and row[0].startswith("sha256:") and row[0] not in keep]
        if stale:
            self.ctr("images", "remove", "--sync", *stale)

    def _import_images(self) -> None:
        for name, ref in self.images_wanted().items():
            self.import_image(ref, self._archives[name])

    def _write_cni(self) -> None:
        a = self.addr
        conf = {
            "cniVersion": "1.0.0",
            "name": "lockstep",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "lsbr0",
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": a.pod_cidr, "gateway": a.gateway}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.work_dir / "cni-ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        d = self.work_dir / "cni"
        d.mkdir(exist_ok=True)
        (d / "10-lockstep.conflist").write_text(json.dumps(conf, indent=2))

    def _kubelet_args(self, cluster: ControlPlane) -> list[str]:
        a = self.addr
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # Kubernetes >= 1.35 refuses cgroup v1 unless told; this machine mounts v1 only.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": a.cgroup_root,
            "address": a.node_ip,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": 10248,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.work_dir / "pki" / "ca.crt")},
            },
            "authorization": {"mode": "Webhook"},
            "clusterDomain": CLUSTER_DOMAIN,
            "clusterDNS": [a.gateway],
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "podLogsDir": str(self.work_dir / "pod-logs"),
            "failSwapOn": False,
            "registerWithTaints": [
                {"key": REAL_NODE_LABEL, "value": REAL_NODE_VALUE, "effect": "NoSchedule"}
            ],
            # Another user's files must not make this node evict our pods or delete our images.
            "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "maxPods": 64,
            "resolvConf": str(self._resolv_conf()),
            "syncFrequency": "10s",
            "fileCheckFrequency": "10s",
            "nodeStatusUpdateFrequency": "5s",
        }
        path = self.work_dir / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        return [
            self._bin("kubelet"),
            f"--config={path}",
            f"--kubeconfig={self._kubeconfig(cluster, f'system:node:{a.node_name}')}",
            f"--root-dir={self.work_dir / 'kubelet'}",
            f"--cert-dir={self.work_dir / 'kubelet-pki'}",
            f"--hostname-override={a.node_name}",
            f"--node-ip={a.node_ip}",
            f"--node-labels={REAL_NODE_LABEL}={REAL_NODE_VALUE}",
            "--v=1",
        ]

    def _kube_router_args(self, cluster: ControlPlane) -> list[str]:
        """Firewall only: no routing (the bridge CNI routes), no service proxy (kube-proxy does)."""
        return [
            self._bin("kube-router"),
            "--run-firewall=true",
            "--run-router=false",
            "--run-service-proxy=false",
            "--run-loadbalancer=false",
            f"--kubeconfig={self._kubeconfig(cluster, 'lockstep:kube-router')}",
            f"--hostname-override={self.addr.node_name}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--enable-ipv4=true",
            "--enable-ipv6=false",
            f"--health-port={KUBE_ROUTER_HEALTH_PORT}",
            "--metrics-port=0",
            "--v=1",
        ]

    def _kube_router_ready(self) -> bool:
        """Its health endpoint answers and its chains hang off FORWARD (the pod-to-pod path)."""
        if not self._curl_ok(f"http://127.0.0.1:{KUBE_ROUTER_HEALTH_PORT}/healthz"):
            return False
        forward = self._run("iptables", "-S", "FORWARD")
        return "KUBE-ROUTER-FORWARD" in forward and "KUBE-NWPLCY-DEFAULT" in self._run("iptables", "-S")

    def iptables_rules(self) -> str:
        """The node's filter table (`iptables -S`): kube-proxy's, the CNI's and kube-router's rules."""
        return self._run("iptables", "-S")

    def ipsets(self) -> str:
        """The names of the node's ipsets (kube-router's KUBE-SRC-*/KUBE-DST-* peer sets), one a line."""
        return self._run("ipset", "list", "-n")

    def _resolv_conf(self) -> Path:
        """For pods with dnsPolicy Default: the cluster DNS too (the host's resolver is not reachable)."""
        path = self.work_dir / "resolv.conf"
        path.write_text(f"nameserver {self.addr.gateway}\n")
        return path

    def _kube_proxy_config(self, cluster: ControlPlane) -> Path:
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self._kubeconfig(cluster, "system:kube-proxy"))},
            "mode": "iptables",
            "clusterCIDR": self.addr.pod_cidr,
            "hostnameOverride": self.addr.node_name,
            "bindAddress": self.addr.node_ip,
            "healthzBindAddress": "127.0.0.1:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            # 0: leave the conntrack sysctls alone (nf_conntrack_max is host-wide).
            "conntrack": {
                "maxPerCore": 0,
                "min": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
            },
        }
        path = self.work_dir / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def _corefile(self, cluster: ControlPlane) -> Path:
        kubeconfig = self._kubeconfig(cluster, "lockstep:coredns")
        text = f"""{CLUSTER_DOMAIN}:53 in-addr.arpa:53 ip6.arpa:53 {{
    errors
    health 127.0.0.1:8080
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} local
        pods insecure
        ttl 5
    }}
}}
"""
        path = self.work_dir / "Corefile"
        path.write_text(text)
        return path

    def _spawn(self, name: str, args: list[str]) -> None:
        log = (self.log_dir / f"{name}.log").open("ab")
        with log:
            self._procs[name] = subprocess.Popen(
                self.nsenter(*args),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_kill_when_parent_dies if self.die_with_parent else None,
                cwd=self.work_dir,
            )

    def _wait(self, name: str, probe: Callable[[], object]) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            proc = self._procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise RealNodeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            with contextlib.suppress(Exception):
                if probe():
                    return
            time.sleep(0.2)
        raise RealNodeError(
            f"{name} not ready after {self.start_timeout:.0f} s; log tail:\n{self.log_tail(name)}"
        )

    def _curl_ok(self, url: str) -> bool:
        # Inside the node's network namespace: python's urllib cannot switch namespaces.
        code = "import sys,urllib.request;urllib.request.urlopen(sys.argv[1],timeout=2)"
        proc = subprocess.run(self.nsenter(_python(), "-c", code, url), capture_output=True, check=False)
        return proc.returncode == 0

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # ------------------------------------------------------------------ state for stop.sh
    def to_state(self) -> dict[str, Any]:
        """What stop() needs from another process: the slot, the namespaces and the work dir."""
        return {
            "slot": self.addr.slot,
            "work_dir": str(self.work_dir),
            "ns": list(self._ns),
            "made_dirs": [str(d) for d in self._made_dirs],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RealNode:
        """A handle on a node started by another process; stop() kills what lives in its namespaces."""
        node = cls(work_dir=Path(state["work_dir"]))
        node.addr = Addresses(int(state["slot"]))
        node._ns = (int(state["ns"][0]), int(state["ns"][1]))
        node._made_dirs = [Path(d) for d in state.get("made_dirs", [])]
        node.milestones["kubelet"] = 0.0  # drain its pods first
        return node

    # ------------------------------------------------------------------ stop
    def drain(self, cluster: ControlPlane, timeout: float = 60.0) -> None:
        """Delete every pod bound to this node and wait until the kubelet has stopped them (it tears
        down their sandboxes and networks), so that stop() rarely needs SIGKILL."""
        name = self.addr.node_name
        cluster.kubectl(
            "delete", "pods", "--all-namespaces", f"--field-selector=spec.nodeName={name}",
            "--grace-period=2", "--wait=false", check=False,
        )  # fmt: skip
        with contextlib.suppress(TimeoutError):
            cluster.wait_for(
                lambda: (
                    not cluster.get("pods", "--all-namespaces", f"--field-selector=spec.nodeName={name}")[
                        "items"
                    ]
                ),
                timeout=timeout,
                what=f"the pods of {name} gone",
            )

    def stop(self, check: bool = True) -> None:
        """Stop the daemons, kill whatever runs in the node's namespaces or cgroups, release the slot;
        check=True raises RealNodeError naming anything left (process, veth, cgroup, host iptables rule
        or ipset)."""
        for name in reversed(DAEMONS):
            proc = self._procs.get(name)
            if proc is not None:
                _terminate(proc)
        for pid in self._node_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self._holder is not None:
            _terminate(self._holder)
        deadline = time.monotonic() + 10
        while self._node_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        left: list[str] = [f"process {p}" for p in self._node_pids()]
        if hasattr(self, "addr"):
            if not _remove_cgroups(self.addr.cgroup_root):
                left.append(f"cgroup {self.addr.cgroup_root}")
            # The kernel frees a dead namespace's devices asynchronously: delete our end, then wait.
            veth = Path(f"/sys/class/net/{self.addr.host_veth}")
            if veth.exists():
                subprocess.run(["ip", "link", "del", self.addr.host_veth], capture_output=True, check=False)
            deadline = time.monotonic() + 10
            while veth.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            if veth.exists():
                left.append(f"veth {self.addr.host_veth}")
            new = set(_iptables_rules().splitlines()) - set(self._iptables_before.splitlines())
            ours = sorted(r for r in new if any(m in r for m in LEFTOVER_MARKERS))
            if ours:  # rules of other users of the machine are theirs, not a leftover of ours
                left.append(f"host iptables rules {ours}")
            sets = sorted(s for s in _ipsets() - self._ipsets_before if any(m in s for m in LEFTOVER_MARKERS))
            if sets:
                left.append(f"host ipsets {sets}")
        for d in self._made_dirs:  # empty on the host: their contents lived in the private tmpfs
            with contextlib.suppress(OSError):
                d.rmdir()
        self._procs.clear()
        self._holder = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        if check and left:
            raise RealNodeError(f"the real node left {left}")

    def _node_pids(self) -> list[int]:
        """Processes in the node's namespaces, or in the kubelet's cgroups (the containers)."""
        if self._ns == (0, 0):
            return []
        found = []
        marker = getattr(self, "addr", None) and self.addr.cgroup_root + "/"
        for pid, net, mnt, cgroup in _proc_namespaces():
            if pid == os.getpid():
                continue
            if net == self._ns[0] or mnt == self._ns[1] or (marker and marker in cgroup):
                found.append(pid)
        return found


# ---------------------------------------------------------------------- helpers
def _node_ready(cluster: ControlPlane, name: str) -> bool:
    node = cluster.api_get(f"/api/v1/nodes/{name}")
    conditions = node.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _python() -> str:
    import sys

    return sys.executable


def _iptables_rules() -> str:
    """The host's iptables rules without counters (the node must not change them)."""
    out = []
    for tool in ("iptables-save", "ip6tables-save"):
        if shutil.which(tool):
            proc = subprocess.run([tool], capture_output=True, text=True, check=False)
            out += [line for line in proc.stdout.splitlines() if not line.startswith(("#", ":"))]
    return "\n".join(out)


def _ipsets() -> frozenset[str]:
    """The names of the host's ipsets (the node's live in its network namespace and die with it)."""
    if not shutil.which("ipset"):
        return frozenset()
    proc = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True, check=False)
    return frozenset(proc.stdout.split())


def _cluster_role_for_user(user: str, rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A ClusterRole named like `user` with `rules`, bound to that (token) user."""
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": user},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": user},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": user},
            "subjects": [{"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}],
        },
    ]


def _proc_namespaces() -> Iterator[tuple[int, int, int, str]]:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            net = os.stat(d / "ns" / "net").st_ino
            mnt = os.stat(d / "ns" / "mnt").st_ino
            cgroup = (d / "cgroup").read_text()
        except OSError:
            continue
        yield int(d.name), net, mnt, cgroup


def _make_cgroups(root: str) -> None:
    """mkdir the cgroup `root` in every v1 hierarchy; a new cpuset gets its parent's cpus and mems."""
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        if not hierarchy.is_dir() or hierarchy.is_symlink():
            continue
        top = hierarchy / root.lstrip("/")
        top.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (hierarchy / knob).exists() and not (top / knob).read_text().strip():
                (top / knob).write_text((hierarchy / knob).read_text())


def _remove_cgroups(root: str) -> bool:
    """rmdir the cgroup subtree `root` in every v1 hierarchy (deepest first); True if none is left."""
    ok = True
    base = Path("/sys/fs/cgroup")
    if not base.exists():
        return True
    for hierarchy in base.iterdir():
        top = hierarchy / root.lstrip("/")
        if not top.is_dir():
            continue
        dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for d in [*dirs, top]:
            for _ in range(100):  # a killed container's cgroup empties a moment after its last process
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        ok = ok and not top.exists()
    return ok


def _terminate(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _kill_when_parent_dies() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def pod_manifest(name: str, image: str, command: list[str], **spec: Any) -> dict[str, Any]:
    """A bare pod pinned to the real node (its selector and toleration), for tests of the node."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {REAL_NODE_LABEL: REAL_NODE_VALUE},
            "tolerations": [
                {
                    "key": REAL_NODE_LABEL,
                    "operator": "Equal",
                    "value": REAL_NODE_VALUE,
                    "effect": "NoSchedule",
                }
            ],
            "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never", "command": command}],
            **spec,
        },
    }
