"""Fast tests of the control plane's helpers and error paths (no running cluster needed).

Why: a broken build or a component that dies at start must say which one and why; wait_for must name
what it waited for; the port check must see a real listener.
"""

from __future__ import annotations

import socket
import stat
from pathlib import Path

import pytest

from e2e.controlplane import ports as portutil
from e2e.controlplane.cluster import (
    COMPONENTS,
    START_ATTEMPTS,
    ControlPlane,
    ControlPlaneError,
    find_binaries,
    wait_for,
)


def test_find_binaries_names_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "etcd").write_text("")
    monkeypatch.setenv("LOCKSTEP_CONTROLPLANE_BIN", str(tmp_path))
    with pytest.raises(ControlPlaneError, match=r"lacks .*kube-apiserver.*unset it"):
        find_binaries()


def fake_bin(tmp_path: Path, message: str) -> Path:
    """Binaries that log `message`, count their runs in tmp_path/runs and exit 3."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in (*COMPONENTS, "kubectl"):
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\necho {name} >> {tmp_path}/runs\necho '{message}' >&2\nexit 3\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def test_a_component_dying_at_start_is_reported_with_its_log(tmp_path: Path) -> None:
    cp = ControlPlane(bin_dir=fake_bin(tmp_path, "etcdmain: bad flag --x"), nodes_file=None, start_timeout=20)
    with pytest.raises(ControlPlaneError, match=r"(?s)etcd exited with 3.*bad flag --x"):
        cp.start()
    assert cp.pids == {}
    assert cp.work_dir is not None and not cp.work_dir.exists()
    assert (tmp_path / "runs").read_text().split() == ["etcd"]  # not retried: not a port race


def test_a_lost_port_race_is_retried_on_new_ports(tmp_path: Path) -> None:
    cp = ControlPlane(
        bin_dir=fake_bin(tmp_path, "listen tcp 127.0.0.1:1: bind: address already in use"), nodes_file=None
    )
    with pytest.raises(ControlPlaneError, match="address already in use"):
        cp.start()
    assert (tmp_path / "runs").read_text().split() == ["etcd"] * START_ATTEMPTS


def test_wait_for_names_the_condition_and_last_value() -> None:
    with pytest.raises(TimeoutError, match=r"waiting for pods Running; last: \[\]"):
        wait_for(list, timeout=0.3, what="pods Running", interval=0.05)


def test_wait_for_reports_the_last_exception_and_returns_the_value() -> None:
    def missing() -> int:
        raise KeyError("pod-0")

    with pytest.raises(TimeoutError, match=r"last: KeyError\('pod-0'\)"):
        wait_for(missing, timeout=0.3, what="pod-0", interval=0.05)
    calls = iter([0, None, 7])
    assert wait_for(lambda: next(calls), timeout=5, what="7", interval=0.01) == 7


def test_listening_sees_a_real_listener_only() -> None:
    with socket.socket() as server, socket.socket() as unbound:
        server.bind(("127.0.0.1", 0))
        server.listen()
        unbound.bind(("127.0.0.1", 0))  # bound but not listening
        port, other = server.getsockname()[1], unbound.getsockname()[1]
        assert portutil.listening([port, other]) == [port]
    assert portutil.listening([port]) == []
    free = portutil.free_ports(5)
    assert len(set(free)) == 5
