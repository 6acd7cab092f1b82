"""The local sandbox's promises, checked with real processes: confinement, deadline, limits, release.

Each command really runs (`sh -c` under Landlock and rlimits); nothing is mocked. Without Landlock
(Linux < 5.13) the local sandbox refuses to start and these tests skip, saying so.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest
from lockstep.sandbox import TIMEOUT_EXIT, LocalSandboxProvider, SandboxConfig, SandboxError
from lockstep.sandbox.landlock import abi_version

pytestmark = pytest.mark.skipif(abi_version() < 1, reason="no Landlock in this kernel (Linux >= 5.13)")


def _provider(tmp_path: Path, **config: object) -> LocalSandboxProvider:
    return LocalSandboxProvider(SandboxConfig(image="unused", **config), tmp_path / "boxes")  # type: ignore[arg-type]


async def test_a_command_cannot_write_outside_its_directory(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("original")
    provider = _provider(tmp_path)
    async with provider.claim("g0-s0") as box:
        inside = await box.exec("echo hi > mine && mkdir d && mv mine d/moved && cat d/moved")
        assert (inside.exit_code, inside.output) == (0, "hi\n")
        for cmd in (
            f"echo changed > {outside}",
            f"rm {outside}",
            f"mv {outside} ./stolen",  # a rename out of a read-only place is a removal there
            f"touch {tmp_path}/new",
            "touch /tmp/lockstep-sandbox-escape",
            f"ln -s /etc/passwd {tmp_path}/link",
        ):
            done = await box.exec(cmd)
            assert done.exit_code != 0, cmd
            assert "denied" in done.output.lower() or "not permitted" in done.output.lower(), (
                cmd,
                done.output,
            )
        quiet = await box.exec("echo x > /dev/null && echo ok")  # the one writable file outside
        assert quiet.output == "ok\n"
    assert outside.read_text() == "original"
    assert not (tmp_path / "new").exists() and not Path("/tmp/lockstep-sandbox-escape").exists()


async def test_a_command_is_killed_at_its_deadline_with_its_children(tmp_path: Path) -> None:
    provider = _provider(tmp_path, command_timeout_s=3)  # room for the first lines on a loaded machine
    async with provider.claim("g0-s0") as box:
        done = await box.exec("sleep 30 & echo $! > bg; echo started; wait")
        assert done.timed_out and done.exit_code == TIMEOUT_EXIT
        assert done.output == "started\n"
        bg = int((box.root / "bg").read_text())
        assert not _alive(bg), "the background child outlived the deadline"
        longer = await box.exec("sleep 1; echo slept", timeout_s=30)  # a per-call deadline overrides
        assert (longer.exit_code, longer.output, longer.timed_out) == (0, "slept\n", False)


async def test_release_kills_what_escaped_the_group_and_removes_the_directory(tmp_path: Path) -> None:
    provider = _provider(tmp_path)
    async with provider.claim("g0-s0") as box:
        await box.exec("setsid -f sh -c 'echo $$ > escaped; exec sleep 60' > /dev/null 2>&1; sleep 0.2")
        root = box.root
        escaped = int((root / "escaped").read_text())
        assert _alive(escaped)  # outside the command's process group: the deadline's kill missed it
    assert not root.exists()
    await asyncio.sleep(0.1)
    assert not _alive(escaped)
    await provider.aclose()


async def test_the_driver_environment_does_not_leak_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCKSTEP_API_KEY", "secret-job-key")
    async with _provider(tmp_path).claim("g0-s0") as box:
        done = await box.exec("env")
    assert "secret-job-key" not in done.output
    assert f"HOME={box.root}" in done.output


@pytest.mark.parametrize("egress", [False, True])
async def test_egress_deny_refuses_tcp(tmp_path: Path, egress: bool) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        async with _provider(tmp_path, egress=egress).claim("g0-s0") as box:
            # python3 is on every machine that runs Lockstep; the sandbox uses the machine's tools
            done = await box.exec(
                f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 2); print(1)'"
            )
    finally:
        listener.close()
    if egress:
        assert done.exit_code == 0, done.output
    else:
        assert done.exit_code != 0 and "PermissionError" in done.output


async def test_limits_cut_output_and_file_size(tmp_path: Path) -> None:
    async with _provider(tmp_path, output_limit=100, disk_bytes=10_000).claim("g0-s0") as box:
        chatty = await box.exec("yes | head -c 100000")
        assert chatty.truncated and len(chatty.output) == 100 and chatty.exit_code == 0
        big = await box.exec("head -c 20000 /dev/zero > big")
        assert big.exit_code != 0
        assert (box.root / "big").stat().st_size <= 10_000


async def test_each_claim_is_a_fresh_directory_and_claims_wait_for_a_free_sandbox(tmp_path: Path) -> None:
    provider = LocalSandboxProvider(SandboxConfig(image="unused"), tmp_path / "boxes", max_sandboxes=1)
    order: list[str] = []

    async def episode(key: str) -> None:
        async with provider.claim(key) as box:
            order.append(f"in {key}")
            assert (await box.exec("ls -A")).output == ""  # nothing of the other episode
            await box.exec("touch left-behind")
            await asyncio.sleep(0.05)
            order.append(f"out {key}")

    await asyncio.gather(episode("a"), episode("b"))
    assert order in (["in a", "out a", "in b", "out b"], ["in b", "out b", "in a", "out a"])
    assert list((tmp_path / "boxes").iterdir()) == []


def test_a_kernel_without_landlock_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import lockstep.sandbox.local as local

    monkeypatch.setattr(local, "abi_version", lambda: 0)
    with pytest.raises(SandboxError, match="Landlock"):
        _provider(tmp_path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[1].split()[0] == "Z")
