"""Lockstep's images (operator, runtime) built here without Docker, for amd64 and arm64.

Why: no Docker engine and no registry here, yet the local cluster must run the images users deploy,
and GB300 nodes (Grace, arm64) need an arm64 variant of every image placed on them. Each image is the
recipe of its Dockerfile in images/, step for step:

1. base layer: Debian bookworm with images/base-packages.txt (mmdebstrap; the Dockerfiles install the
   same list on debian:bookworm-slim). arm64: the same packages unpacked without running their
   maintainer scripts (this machine cannot execute arm64 code without emulation).
2. dependency layer: `images/install.sh deps EXTRAS /opt/lockstep`, the one install step of every
   Dockerfile, run here with pip's --platform options so that it installs the target architecture's
   wheels (PyPI has x86_64 and aarch64 wheels of every pinned version, CUDA torch included).
3. package layer: `images/install.sh package EXTRAS /opt/lockstep` (this checkout's lockstep wheel and
   the commands), the venv shell (bin/python -> Debian's python3.11) and the image's user.

A layer is rebuilt only when its inputs change: the base's package list and architecture, the
dependency layer's constraints.txt + extras + pyproject.toml's requirements + install.sh, the
package layer's sources. `make images` writes each image as one multi-architecture OCI archive
(an image index over amd64 and arm64) named `ghcr.io/lockstep/lockstep-<name>:<version>`
(lockstep.api.images), which `skopeo copy --all oci-archive:FILE docker://REGISTRY/...` pushes; the
real node (e2e/controlplane/realnode.py) imports the amd64 image of the same recipe.
`python -m e2e.controlplane.node.runtime_image [--image NAME] [--arch ARCH] [--out DIR]` builds by
hand and prints each build's time and size.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lockstep.api.images import image_ref, version

from e2e.controlplane.node.images import Entry, ImageSpec, build_archive, build_index, write_layer

REPO = Path(__file__).resolve().parents[3]
CACHE = Path(os.environ.get("LOCKSTEP_CACHE", Path.home() / ".cache" / "lockstep")) / "node"
IMAGES_DIR = REPO / "images"
INSTALL = IMAGES_DIR / "install.sh"
SUITE = "bookworm"
PY = "python3.11"
"""Debian bookworm's python3 (the ABI of the wheels installed)."""
PREFIX = "opt/lockstep"
ARCHES = {"amd64": "x86_64", "arm64": "aarch64"}
"""OCI architecture -> the machine name in wheel tags."""
GLIBC_MINOR = 36
"""bookworm's glibc is 2.36: every manylinux tag up to it fits."""


@dataclass(frozen=True, slots=True)
class Recipe:
    """One image: what images/<name>.Dockerfile builds."""

    name: str
    extras: str
    """lockstep's extras (install.sh's EXTRAS)."""
    uid: int
    cmd: tuple[str, ...]
    entry_check: tuple[str, ...]
    """A command proving the image's entry works (the e2e tests run it in a pod, and under emulation
    for arm64)."""


RECIPES = {
    "operator": Recipe(
        "operator",
        "",
        65532,
        ("lockstep-operator",),
        (
            "python",
            "-c",
            "import lockstep_operator.handlers, sys; assert 'torch' not in sys.modules; print('ok')",
        ),
    ),
    "runtime": Recipe(
        "runtime",
        "runtime,p2p,megatron",
        1000,
        ("lockstep", "--help"),
        # The default trainer backend is megatron: its entry must import megatron-core here.
        ("python", "-c", "import lockstep.cli, megatron.core, torch; print('ok', torch.__version__)"),
    ),
}


def base_packages() -> list[str]:
    lines = (IMAGES_DIR / "base-packages.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def host_arch() -> str:
    return {"x86_64": "amd64", "aarch64": "arm64"}[os.uname().machine]


def base_layer(arch: str = "amd64") -> Path:
    """The Debian rootfs tar (mmdebstrap, minbase + base-packages.txt), built once per package list
    and architecture."""
    packages = base_packages()
    key = hashlib.sha256(f"{SUITE} {' '.join(packages)}".encode()).hexdigest()[:12]
    suffix = "" if arch == "amd64" else f"-{arch}"  # amd64 keeps the name earlier builds cached
    path = CACHE / f"debian-{SUITE}-{key}{suffix}.tar"
    if path.exists():
        return path
    if shutil.which("mmdebstrap") is None:
        raise RuntimeError("mmdebstrap is missing: run `bash e2e/controlplane/node/deps.sh` (as root)")
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp.{os.getpid()}")
    cmd = ["mmdebstrap", f"--architectures={arch}", f"--include={','.join(packages)}", "--format=tar"]
    if arch == host_arch():
        cmd += ["--variant=minbase", "--mode=root"]
    else:  # no emulation needed: unpack, run no maintainer script (the image's files are the same)
        cmd += ["--variant=extract", "--mode=root"]
    cmd += [SUITE, str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"mmdebstrap failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    tmp.rename(path)
    return path


def requirements(extras: str) -> list[str]:
    """lockstep's requirements for `extras`, as install.sh reads them from pyproject.toml."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in filter(None, extras.split(",")):
        reqs += project["optional-dependencies"][extra]
    return reqs


def deps_key(recipe: Recipe, arch: str) -> str:
    """Digest of the dependency layer's inputs."""
    h = hashlib.sha256(f"{arch} {recipe.extras} {PY}".encode())
    h.update("\n".join(requirements(recipe.extras)).encode())
    h.update((REPO / "constraints.txt").read_bytes())
    h.update(INSTALL.read_bytes())
    return h.hexdigest()[:12]


def project_key() -> str:
    """Digest of this checkout's package sources and install step: the package layer's key."""
    h = hashlib.sha256(INSTALL.read_bytes())
    for path in sorted(_project_files()):
        h.update(str(path.relative_to(REPO)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _project_files() -> Iterator[Path]:
    for pkg in (REPO / "runtime" / "lockstep", REPO / "operator" / "lockstep_operator"):
        for path in pkg.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                yield path
    yield REPO / "pyproject.toml"


def pip_platform_args(arch: str) -> list[str]:
    """pip options installing `arch`'s CPython 3.11 wheels on any machine (install.sh's PIP OPTIONs)."""
    machine = ARCHES[arch]
    out = ["--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--only-binary=:all:"]
    for minor in range(GLIBC_MINOR, 16, -1):
        out += ["--platform", f"manylinux_2_{minor}_{machine}"]
    return [*out, "--platform", f"manylinux2014_{machine}", "--platform", f"linux_{machine}"]


def install(mode: str, recipe: Recipe, arch: str, root: Path) -> None:
    """Run images/install.sh `mode` into root/opt/lockstep with this interpreter's pip."""
    env = {**os.environ, "PIP": f"{sys.executable} -m pip", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env["DESTDIR"] = str(root)  # the commands' interpreter line names /opt/lockstep, not root
    cmd = ["sh", str(INSTALL), mode, recipe.extras, f"/{PREFIX}", *pip_platform_args(arch)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"images/install.sh {mode} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )


def _tree(src: Path, dst: str, uid: int = 0) -> Iterator[Entry]:
    """Entries for a directory tree (files, dirs, symlinks), skipping bytecode caches."""
    yield Entry(dst, uid=uid)
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = Path(root).relative_to(src)
        for d in dirs:
            p = Path(root) / d
            target = f"{dst}/{rel / d}".replace("/./", "/")
            if p.is_symlink():
                yield Entry(target, link=os.readlink(p), mode=0o777)
            else:
                yield Entry(target, uid=uid)
        for f in files:
            p = Path(root) / f
            target = f"{dst}/{rel / f}".replace("/./", "/")
            if p.is_symlink():
                yield Entry(target, link=os.readlink(p), mode=0o777)
            else:
                yield Entry(target, source=p, mode=p.stat().st_mode & 0o777)


def _parents(path: str) -> list[Entry]:
    parts = path.split("/")
    return [Entry("/".join(parts[: i + 1])) for i in range(len(parts) - 1)]


def deps_layer(recipe: Recipe, arch: str) -> Path:
    """The dependency layer tar (install.sh deps), rebuilt only when its inputs change."""
    path = CACHE / "layers" / f"deps-{recipe.name}-{arch}-{deps_key(recipe, arch)}.tar"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time: two test runs on one machine otherwise delete each other's temporary tar.
    with (path.parent / "deps.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            for old in path.parent.glob(f"deps-{recipe.name}-{arch}-*"):
                old.unlink()  # each is gigabytes: keep the current one only
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                install("deps", recipe, arch, Path(tmp))
                entries = [*_parents(PREFIX), *_tree(Path(tmp) / PREFIX, PREFIX)]
                part = path.with_suffix(f".tmp.{os.getpid()}")
                write_layer(entries, part)
                part.rename(path)
    return path


MINIMAL_ACCOUNTS = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "etc/group": "root:x:0:\nnogroup:x:65534:\n",
}
"""What an unpacked rootfs (no maintainer script ran, so base-passwd wrote nothing) gets instead."""


def _passwd_entries(base: Path, recipe: Recipe) -> list[Entry]:
    """The base's /etc/passwd and /etc/group (MINIMAL_ACCOUNTS where none was written) plus the image's
    `lockstep` user, as the Dockerfile's useradd writes it."""
    uid = recipe.uid
    add = {
        "etc/passwd": f"lockstep:x:{uid}:{uid}::/home/lockstep:/usr/sbin/nologin\n",
        "etc/group": f"lockstep:x:{uid}:\n",
    }
    out = []
    with tarfile.open(base) as tar:
        names = set(tar.getnames())
        for name, line in add.items():
            member = tar.extractfile(f"./{name}") if f"./{name}" in names else None
            head = member.read() if member is not None else MINIMAL_ACCOUNTS[name].encode()
            out.append(Entry(name, data=head + line.encode(), mode=0o644))
    return out


def image_spec(recipe: Recipe, arch: str, package_root: Path) -> ImageSpec:
    """Base, dependencies, then the package (installed under package_root by install.sh package)."""
    base = base_layer(arch)
    site = f"{PREFIX}/lib/{PY}/site-packages"
    entries = [
        *_parents(site),
        Entry(site),
        *_tree(package_root / PREFIX / "bin", f"{PREFIX}/bin"),
        Entry(f"{PREFIX}/bin/python", link=f"/usr/bin/{PY}", mode=0o777),
        Entry(f"{PREFIX}/bin/python3", link="python", mode=0o777),
        Entry(
            f"{PREFIX}/pyvenv.cfg",
            data=b"home = /usr/bin\ninclude-system-site-packages = false\n",
            mode=0o644,
        ),
        Entry("home"),
        Entry("home/lockstep", uid=recipe.uid),
        Entry("tmp", mode=0o1777),
        *_passwd_entries(base, recipe),
    ]
    for child in sorted((package_root / site).iterdir()):
        if child.is_dir():
            entries += _tree(child, f"{site}/{child.name}")
        else:
            entries.append(Entry(f"{site}/{child.name}", source=child, mode=0o644))
    return ImageSpec(
        name=recipe.name,
        layer_files=[base, deps_layer(recipe, arch)],
        entries=entries,
        env={
            "PATH": f"/{PREFIX}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            "HOME": "/home/lockstep",
        },
        user=f"{recipe.uid}:{recipe.uid}",
        workdir="/home/lockstep",
        cmd=recipe.cmd,
        architecture=arch,
        labels={
            "org.opencontainers.image.title": f"lockstep-{recipe.name}",
            "org.opencontainers.image.version": version(),
            "org.opencontainers.image.source": "images/" + f"{recipe.name}.Dockerfile",
        },
    )


def local_ref(name: str, arch: str = "amd64") -> str:
    """The reference of the locally built image: a digest of its inputs (cheap: no layer is read)."""
    recipe = RECIPES[name]
    base = base_layer(arch)
    key = f"{base.name} {deps_key(recipe, arch)} {project_key()} {arch}"
    return f"lockstep.local/{name}:{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def image_archive(
    name: str, out_dir: Path, arch: str = "amd64", have: frozenset[str] = frozenset()
) -> tuple[str, Path]:
    """Write image `name` for `arch` as a single-architecture OCI archive under out_dir; (reference,
    path). Layers whose digests are in `have` (already imported into the target containerd) are left
    out, so a change to this checkout's code writes and imports only the small package layer."""
    ref = local_ref(name, arch)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        install("package", RECIPES[name], arch, Path(tmp))
        built_ref, path = build_archive(
            image_spec(RECIPES[name], arch, Path(tmp)), out_dir, tag=ref.rsplit(":", 1)[1], omit=have
        )
    assert built_ref == ref, (built_ref, ref)
    return ref, path


def multiarch_archive(
    name: str, out_dir: Path, arches: tuple[str, ...] = ("amd64", "arm64")
) -> tuple[str, Path]:
    """Write image `name` for every arch in `arches` as one OCI archive holding an image index, named
    by its published reference (lockstep.api.images.image_ref); (reference, path)."""
    ref = image_ref(name)
    path = out_dir / f"lockstep-{name}-{version()}.oci.tar"
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        specs = []
        for arch in arches:
            root = Path(tmp) / arch
            install("package", RECIPES[name], arch, root)
            specs.append(image_spec(RECIPES[name], arch, root))
        build_index(specs, ref, path)
    return ref, path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.controlplane.node.runtime_image", description=__doc__
    )
    parser.add_argument("--image", action="append", choices=sorted(RECIPES), help="default: every image")
    parser.add_argument("--arch", action="append", choices=sorted(ARCHES), help="default: amd64 and arm64")
    parser.add_argument("--out", type=Path, default=REPO / "dist" / "images")
    parser.add_argument("--json", type=Path, help="also write the timings and sizes here")
    args = parser.parse_args(argv)
    arches = tuple(args.arch or ("amd64", "arm64"))
    report = []
    for name in args.image or sorted(RECIPES):
        t0 = time.monotonic()
        ref, path = multiarch_archive(name, args.out, arches)
        row = {"image": name, "ref": ref, "path": str(path), "arches": list(arches),
               "bytes": path.stat().st_size, "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip
        report.append(row)
        print(
            f"{ref} ({', '.join(arches)}): {path} ({row['bytes'] / 2**30:.2f} GiB) in {row['seconds']:.0f} s"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
