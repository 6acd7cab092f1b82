"""Can this machine run a real node? The capability probe of the real-node build and tests.

Why: `make test` runs the real-pod e2e tests (e2e/test_realnode.py, e2e/test_realpods.py) wherever
the machine can run containers, and skips them with one line saying what is missing where it cannot
(a container without privileges, a cgroup v2-only host, a kernel without veth or bridge netfilter):
a machine of another kind must never turn CI red, and a machine that can must run them.

What it checks, in order: Linux and root; cgroup v1 hierarchies that accept a new cgroup (the node's
cgroupfs driver and realnode.py's cgroup handling are v1); overlayfs (containerd's snapshotter);
the Debian packages of node/deps.sh (installed when missing and apt-get works); then, inside a
throwaway network + mount namespace, a veth pair, a bridge with bridge netfilter, iptables' nat table,
an ipset matched by an iptables rule with the physdev match (what kube-router enforces NetworkPolicy
with) and a tmpfs mount (all gone with the namespace); last, runc runs a container (busybox `true`).

LOCKSTEP_REAL_NODE: `0` skips the real node whatever the machine; `1` requires it (a missing
capability is an error, not a skip: `make test-realnode`); unset: probe and decide.

Used by the Makefile (`python -m e2e.controlplane.node.probe`: exit 0 and no output when capable,
else exit 3 and the skip line on stderr) and by e2e/conftest.py (`skip_reason()`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEPS = HERE / "deps.sh"
CACHE = Path(os.environ.get("LOCKSTEP_CACHE", Path.home() / ".cache" / "lockstep"))
CGROUP = Path("/sys/fs/cgroup")
TOOLS = ("containerd", "runc", "ctr", "iptables", "ipset", "unshare", "nsenter", "ip", "mmdebstrap")
ELSEWHERE = (
    "run them on a Linux machine or VM with root, cgroup v1, veth/bridge/iptables "
    "(Debian bookworm works): `make test-realnode` (docs/controlplane.md, 'A real node')"
)

NAMESPACE_SCRIPT = r"""
ip link add lsprobe0 type veth peer name lsprobe1 >/dev/null 2>&1 || echo "veth pairs"
ip link add lsprobebr type bridge >/dev/null 2>&1 || echo "bridges"
[ -e /proc/sys/net/bridge/bridge-nf-call-iptables ] || echo "bridge netfilter (br_netfilter)"
iptables -t nat -S >/dev/null 2>&1 || echo "iptables nat table"
{ ipset create lsprobe hash:ip && iptables -A FORWARD -m set --match-set lsprobe src -m physdev \
  --physdev-is-bridged -j ACCEPT; } >/dev/null 2>&1 || echo "ipset with iptables set/physdev matches (NetworkPolicy)"
mount -t tmpfs lsprobe /mnt >/dev/null 2>&1 || echo "mounts in a private mount namespace"
"""


def missing(install: bool = True) -> list[str]:
    """What this machine lacks to run a real node (empty: it can). `install`: run deps.sh for missing
    Debian packages first (apt-get, root)."""
    if sys.platform != "linux":
        return [f"Linux (this is {sys.platform})"]
    if os.geteuid() != 0:
        return ["root (network and mount namespaces, cgroups, containerd)"]
    lacks = _cgroup_v1()
    if "overlay" not in Path("/proc/filesystems").read_text().split():
        lacks.append("overlayfs in the kernel")
    if lacks:
        return lacks
    tools = [t for t in TOOLS if shutil.which(t) is None] or (
        [] if Path("/usr/lib/cni/bridge").exists() else ["cni"]
    )
    if tools or not (CACHE / "node" / "busybox" / "bin" / "busybox").exists():
        if not install or shutil.which("apt-get") is None:
            return [f"{', '.join(tools or ['busybox-static'])} (and no apt-get to install them)"]
        proc = subprocess.run(["bash", str(DEPS)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            return [f"the Debian packages of node/deps.sh (it failed: {tail})"]
    proc = subprocess.run(
        ["unshare", "--net", "--mount", "--propagation", "private", "sh", "-c", NAMESPACE_SCRIPT],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if proc.returncode != 0 and not proc.stdout.strip():
        return [f"network + mount namespaces (unshare: {proc.stderr.strip()[-200:]})"]
    lacks = proc.stdout.split("\n")
    lacks = [line for line in lacks if line.strip()]
    return lacks or _runc_runs()


def _cgroup_v1() -> list[str]:
    hierarchies = [d for d in CGROUP.glob("*") if (d / "tasks").exists()] if CGROUP.is_dir() else []
    if not hierarchies:
        kind = "cgroup2 only" if (CGROUP / "cgroup.controllers").exists() else "no cgroup mount"
        return [f"cgroup v1 hierarchies under /sys/fs/cgroup ({kind})"]
    probe = hierarchies[0] / f"lockstep-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as err:
        return [f"a writable cgroup v1 hierarchy ({hierarchies[0]}: {err.strerror})"]
    return []


def _runc_runs() -> list[str]:
    """runc runs `true` in a container (all namespaces, cgroups) with busybox as its rootfs."""
    busybox = CACHE / "node" / "busybox" / "bin" / "busybox"
    with tempfile.TemporaryDirectory(prefix="lockstep-probe-") as tmp:
        bundle = Path(tmp)
        (bundle / "rootfs" / "bin").mkdir(parents=True)
        shutil.copy(busybox, bundle / "rootfs" / "bin" / "busybox")
        subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True, capture_output=True)
        config = json.loads((bundle / "config.json").read_text())
        config["process"].update(terminal=False, args=["/bin/busybox", "true"])
        config["root"]["readonly"] = True
        (bundle / "config.json").write_text(json.dumps(config))
        cmd = [
            "runc",
            "--root",
            str(bundle / "state"),
            "run",
            "--bundle",
            str(bundle),
            f"lsprobe-{os.getpid()}",
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
        except subprocess.TimeoutExpired:
            return ["runc running a container (timed out after 60 s)"]
        if proc.returncode != 0:
            return [f"runc running a container ({(proc.stderr.strip() or '?').splitlines()[-1][-200:]})"]
    return []


@functools.cache
def skip_reason() -> str | None:
    """None when the real-node tests should run here; else the one line that skips them. Raises when
    LOCKSTEP_REAL_NODE=1 and the machine cannot."""
    wanted = os.environ.get("LOCKSTEP_REAL_NODE", "")
    if wanted == "0":
        return "real node disabled (LOCKSTEP_REAL_NODE=0)"
    lacks = missing()
    if not lacks:
        return None
    line = f"real node: this machine lacks {'; '.join(lacks)}; {ELSEWHERE}"
    if wanted == "1":
        raise RuntimeError(f"LOCKSTEP_REAL_NODE=1 but {line}")
    return line


def main() -> int:
    try:
        reason = skip_reason()
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 2
    if reason is None:
        return 0
    print(f"SKIPPED {reason}", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
