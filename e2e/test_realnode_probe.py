"""The real-node capability probe (e2e/controlplane/node/probe.py) names what a machine lacks.

Why: `make test` builds the real node and runs the real-pod tests only where the machine can run
containers; elsewhere one line must say what is missing, never a red run. The machines that cannot
are made here from this one: a process without root (setpriv), and root in a user namespace, where
everything but starting a container works (runc cannot mount /dev/pts there).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.controlplane.node import probe

ROOT = Path(__file__).resolve().parent.parent
PROBE = [sys.executable, "-m", "e2e.controlplane.node.probe"]

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root")


def _run(prefix: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """The probe under `prefix`, with LOCKSTEP_REAL_NODE only as `env` sets it (not the caller's)."""
    inherited = {k: v for k, v in os.environ.items() if k != "LOCKSTEP_REAL_NODE"}
    environ = {**inherited, "HOME": os.environ.get("HOME", "/root"), **env}
    return subprocess.run(
        [*prefix, *PROBE], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120
    )


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _as_nobody() -> list[str]:
    """The prefix that runs the probe as user nobody; skips where nobody cannot read this checkout or
    its interpreter (e.g. a checkout under /root)."""
    ok = subprocess.run([*NOBODY, sys.executable, "-c", "import e2e.controlplane.node.probe"], cwd=ROOT,
                        capture_output=True, check=False, timeout=60)  # fmt: skip
    if ok.returncode != 0:
        pytest.skip("user nobody cannot run this checkout's python here")
    return NOBODY


@needs_root
def test_without_root_it_skips_with_one_line() -> None:
    proc = _run(_as_nobody())
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("SKIPPED real node: this machine lacks root"), lines
    assert "make test-realnode" in lines[0]


@needs_root
def test_required_but_missing_is_an_error() -> None:
    proc = _run(_as_nobody(), LOCKSTEP_REAL_NODE="1")
    assert (
        proc.returncode == 2 and "LOCKSTEP_REAL_NODE=1 but real node: this machine lacks root" in proc.stderr
    )


@needs_root
def test_root_in_a_user_namespace_cannot_start_a_container() -> None:
    if probe.missing(install=False):
        pytest.skip(f"this machine cannot run a real node anyway: {probe.missing(install=False)}")
    if subprocess.run(["unshare", "--user", "--map-root-user", "true"], check=False).returncode != 0:
        pytest.skip("no user namespaces here")
    proc = _run(["unshare", "--user", "--map-root-user"])
    assert proc.returncode == 3, proc.stderr
    assert "lacks runc running a container" in proc.stderr or "lacks a writable cgroup" in proc.stderr, (
        proc.stderr
    )


def test_disabled_skips_without_probing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCKSTEP_REAL_NODE", "0")
    probe.skip_reason.cache_clear()
    try:
        assert probe.skip_reason() == "real node disabled (LOCKSTEP_REAL_NODE=0)"
    finally:
        probe.skip_reason.cache_clear()


@needs_root
def test_a_capable_machine_passes_and_the_probe_leaves_nothing() -> None:
    """Where the machine can run the real node, the probe's veth, bridge, ipset, mounts (throwaway
    namespace), cgroup and runc container are gone afterwards."""
    if lacks := probe.missing():
        pytest.skip(f"this machine cannot run a real node: {lacks}")
    assert not list(Path("/sys/class/net").glob("lsprobe*"))
    assert not list(Path("/sys/fs/cgroup").glob("*/lockstep-probe-*"))
    assert not list(Path("/sys/fs/cgroup").glob("*/lsprobe-*"))
    assert "lsprobe" not in Path("/proc/self/mountinfo").read_text()
    sets = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True, check=True).stdout
    assert "lsprobe" not in sets.split()  # its ipset lived in the throwaway namespace
