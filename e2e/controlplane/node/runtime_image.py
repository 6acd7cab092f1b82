"""The runtime image (images/runtime.Dockerfile's role) built here for the real node, without Docker.

Why: no registry and no Docker engine here, and PyPI's torch for Linux is the CUDA build, so the
image is made from what this machine has: a Debian rootfs from Debian packages (mmdebstrap, with
Debian's Python 3.11) as the base layer, and a second layer holding a virtual environment at
/opt/lockstep whose site-packages are copied from this checkout's Python environment (the same
wheels `make setup` installed, minus tools the pods never run), plus this checkout's `lockstep` and
`lockstep_operator` packages and their console scripts. Like the Dockerfile: user 1000, workdir
/home/lockstep, `lockstep` on PATH. Elsewhere images/runtime.Dockerfile still builds the production
image on a CUDA base.

Rebuilt only when its inputs change: the tag is a digest of the base package list, the installed
distributions (names, versions and RECORD files) and this checkout's package sources.
Called by e2e/controlplane/realnode.py; `python -m e2e.controlplane.node.runtime_image` builds it by
hand and prints the build time and size.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

from e2e.controlplane.node.images import Entry, ImageSpec, build_archive, write_layer

REPO = Path(__file__).resolve().parents[3]
CACHE = Path(os.environ.get("LOCKSTEP_CACHE", Path.home() / ".cache" / "lockstep")) / "node"
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "libstdc++6", "libgomp1", "ca-certificates")
"""Debian's python3 is 3.11 in bookworm (the ABI of the wheels copied in); libstdc++/libgomp for torch."""
PY = "python3.11"
PREFIX = "opt/lockstep"
SKIP_TOP = frozenset(
    {"triton", "mypy", "mypyc", "ruff", "pip", "setuptools", "_pytest", "pytest", "__pycache__"}
)
"""Top-level site-packages entries the pods never use (triton only compiles GPU kernels)."""
SCRIPTS = {
    "lockstep": "from lockstep.cli import main",
    "lockstep-operator": "from lockstep_operator.__main__ import main",
    "torchrun": "from torch.distributed.run import main",
}


def base_layer() -> Path:
    """The Debian rootfs tar (mmdebstrap, minbase + BASE_PACKAGES), built once per package list."""
    key = hashlib.sha256(f"{SUITE} {' '.join(BASE_PACKAGES)}".encode()).hexdigest()[:12]
    path = CACHE / f"debian-{SUITE}-{key}.tar"
    if path.exists():
        return path
    if shutil.which("mmdebstrap") is None:
        raise RuntimeError("mmdebstrap is missing: run `bash e2e/controlplane/node/deps.sh` (as root)")
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp.{os.getpid()}")
    cmd = ["mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", "--mode=root"]
    cmd += ["--format=tar", SUITE, str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"mmdebstrap failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    tmp.rename(path)
    return path


def site_packages(venv: Path) -> Path:
    return venv / "lib" / PY / "site-packages"


def _wanted(name: str) -> bool:
    # The editable install of this checkout is replaced by a copy of its packages.
    editable = name.startswith(("__editable__", "lockstep-", "distutils-precedence"))
    return not (name in SKIP_TOP or editable or "mypyc" in name)


def site_key(venv: Path) -> str:
    """Digest of the installed distributions (names, versions, RECORD files): the big layer's key."""
    h = hashlib.sha256(" ".join(sorted(SKIP_TOP)).encode())
    for dist in sorted(site_packages(venv).glob("*.dist-info")):
        if not _wanted(dist.name):
            continue
        h.update(dist.name.encode())
        record = dist / "RECORD"
        if record.exists():
            h.update(hashlib.sha256(record.read_bytes()).digest())
    return h.hexdigest()[:12]


def project_key() -> str:
    """Digest of this checkout's package sources: the small top layer's key."""
    h = hashlib.sha256()
    for path in sorted(_project_files()):
        h.update(str(path.relative_to(REPO)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _project_files() -> Iterator[Path]:
    for pkg in (REPO / "runtime" / "lockstep", REPO / "operator" / "lockstep_operator"):
        for path in pkg.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                yield path


def _tree(src: Path, dst: str) -> Iterator[Entry]:
    """Entries for a directory tree (files, dirs, symlinks), skipping bytecode caches."""
    yield Entry(dst)
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = Path(root).relative_to(src)
        for d in dirs:
            p = Path(root) / d
            if p.is_symlink():
                yield Entry(f"{dst}/{rel / d}", link=os.readlink(p), mode=0o777)
            else:
                yield Entry(f"{dst}/{rel / d}".replace("/./", "/"))
        for f in files:
            p = Path(root) / f
            target = f"{dst}/{rel / f}".replace("/./", "/")
            if p.is_symlink():
                yield Entry(target, link=os.readlink(p), mode=0o777)
            else:
                yield Entry(target, source=p, mode=p.stat().st_mode & 0o777)


def _passwd_entries(base: Path) -> list[Entry]:
    """The base's /etc/passwd and /etc/group plus the `lockstep` user (uid 1000) of the Dockerfile."""
    out = []
    with tarfile.open(base) as tar:
        for name, line in (("etc/passwd", "lockstep:x:1000:1000::/home/lockstep:/usr/sbin/nologin\n"),
                           ("etc/group", "lockstep:x:1000:\n")):  # fmt: skip
            member = tar.extractfile(f"./{name}")
            assert member is not None
            out.append(Entry(name, data=member.read() + line.encode(), mode=0o644))
    return out


def site_layer(venv: Path) -> Path:
    """The third-party site-packages as a layer tar (~5 GiB), rebuilt only when a distribution changes."""
    path = CACHE / "layers" / f"site-packages-{site_key(venv)}.tar"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time: two test runs on one machine otherwise delete each other's temporary tar.
    with (path.parent / "site-packages.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            _build_site_layer(venv, path)
    return path


def _build_site_layer(venv: Path, path: Path) -> None:
    target = f"{PREFIX}/lib/{PY}/site-packages"
    # Under the lock every other layer or temporary tar is stale: one at a time, each is gigabytes.
    for old in path.parent.glob("site-packages-*"):
        old.unlink()
    entries = [
        Entry("opt"),
        Entry(PREFIX),
        Entry(f"{PREFIX}/lib"),
        Entry(f"{PREFIX}/lib/{PY}"),
        Entry(target),
    ]
    for child in sorted(site_packages(venv).iterdir()):
        if not _wanted(child.name):
            continue
        if child.is_dir() and not child.is_symlink():
            entries += _tree(child, f"{target}/{child.name}")
        else:
            entries.append(Entry(f"{target}/{child.name}", source=child, mode=child.stat().st_mode & 0o777))
    tmp = path.with_suffix(f".tmp.{os.getpid()}")
    write_layer(entries, tmp)
    tmp.rename(path)


def runtime_spec(venv: Path, base: Path) -> ImageSpec:
    """Base rootfs, then the site-packages layer, then this checkout's packages and the venv's shell."""
    target = f"{PREFIX}/lib/{PY}/site-packages"
    entries = [
        Entry("opt"),
        Entry(PREFIX),
        Entry(f"{PREFIX}/bin"),
        Entry(f"{PREFIX}/lib"),
        Entry(f"{PREFIX}/lib/{PY}"),
        Entry(target),
        Entry(f"{PREFIX}/bin/python", link=f"/usr/bin/{PY}", mode=0o777),
        Entry(f"{PREFIX}/bin/python3", link="python", mode=0o777),
        Entry(
            f"{PREFIX}/pyvenv.cfg",
            data=b"home = /usr/bin\ninclude-system-site-packages = false\n",
            mode=0o644,
        ),
        Entry("home"),
        Entry("home/lockstep", uid=1000),
        *_passwd_entries(base),
    ]
    for script, imp in SCRIPTS.items():
        body = f"#!/{PREFIX}/bin/python\nimport sys\n{imp}\nsys.exit(main())\n"
        entries.append(Entry(f"{PREFIX}/bin/{script}", data=body.encode(), mode=0o755))
    entries += _tree(REPO / "runtime" / "lockstep", f"{target}/lockstep")
    entries += _tree(REPO / "operator" / "lockstep_operator", f"{target}/lockstep_operator")
    return ImageSpec(
        name="runtime",
        layer_files=[base, site_layer(venv)],
        entries=entries,
        env={
            "PATH": f"/{PREFIX}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            "HOME": "/home/lockstep",
        },
        user="1000:1000",
        workdir="/home/lockstep",
        cmd=["lockstep", "--help"],
    )


def default_venv() -> Path:
    """The checkout's environment: ./.venv (make setup), else the interpreter running this."""
    local = REPO / ".venv"
    return local if (local / "bin" / "python").exists() else Path(sys.prefix)


def runtime_ref(venv: Path | None = None) -> str:
    """The image's reference: a digest of its three inputs (cheap: no layer is read)."""
    venv = venv or default_venv()
    key = hashlib.sha256(f"{base_layer().name} {site_key(venv)} {project_key()}".encode()).hexdigest()[:12]
    return f"lockstep.local/runtime:{key}"


def runtime_archive(
    out_dir: Path, venv: Path | None = None, have: frozenset[str] = frozenset()
) -> tuple[str, Path]:
    """Write the runtime image's OCI archive under out_dir; (reference, path). Layers whose digests are
    in `have` (already imported into the target containerd) are left out of the archive, so a change
    to this checkout's code writes and imports only the small top layer."""
    venv = venv or default_venv()
    ref = runtime_ref(venv)
    built_ref, path = build_archive(
        runtime_spec(venv, base_layer()), out_dir, tag=ref.rsplit(":", 1)[1], omit=have
    )
    assert built_ref == ref, (built_ref, ref)
    return ref, path


def main() -> int:
    t0 = time.monotonic()
    ref, path = runtime_archive(CACHE / "images")
    print(f"{ref}: {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
