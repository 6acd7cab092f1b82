"""OCI image archives assembled here, without Docker or a registry, for the real node's containerd.

Why: no registry is reachable, so every image is written as an OCI image-layout tarball from local
files (a static binary, Debian's static busybox, a Debian rootfs, this checkout's Python env) and
imported with `ctr images import`. Layers are written deterministically (sorted entries, zero
mtimes, root owner), and an image's tag is a digest of its inputs, so an unchanged image is never
rebuilt or re-imported. Called by e2e/controlplane/realnode.py and runtime_image.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REGISTRY = "lockstep.local"
"""The made-up registry host of locally built images (never contacted: pods use IfNotPresent/Never)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One file, directory or symlink of a layer."""

    path: str
    """Path inside the image, without a leading slash."""
    source: Path | None = None
    """A file to copy (regular files); None for a directory, a symlink or inline `data`."""
    link: str = ""
    """Symlink target; set for symlinks only."""
    mode: int = 0o755
    data: bytes | None = None
    """Inline file content (instead of `source`)."""
    uid: int = 0


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """An image: its name (without tag), layers (bottom first) and runtime config."""

    name: str
    entries: Sequence[Entry] = ()
    """The top layer's files (may be empty when `layer_files` says everything)."""
    layer_files: Sequence[Path] = ()
    """Ready-made uncompressed layer tars below the top layer (e.g. a Debian rootfs from mmdebstrap)."""
    entrypoint: Sequence[str] = ()
    cmd: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    user: str = ""
    workdir: str = ""
    architecture: str = "amd64"
    """The OCI platform architecture (amd64, arm64) of the files in the layers."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Image config labels (org.opencontainers.image.version, ...)."""


MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"


def platform_of(arch: str) -> dict[str, str]:
    """The OCI platform of a Linux architecture (arm64 is the v8 variant, as registries spell it)."""
    out = {"architecture": arch, "os": "linux"}
    if arch == "arm64":
        out["variant"] = "v8"
    return out


def write_layer(entries: Iterable[Entry], path: Path) -> None:
    """Write a layer tar of the entries (sorted, zero mtimes) to path, streaming file contents."""
    with tarfile.open(path, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in sorted(entries, key=lambda x: x.path):
            info = tarfile.TarInfo(e.path)
            info.mode, info.mtime, info.uid, info.gid = e.mode, 0, e.uid, e.uid
            if e.link:
                info.type, info.linkname = tarfile.SYMTYPE, e.link
                tar.addfile(info)
            elif e.data is not None:
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
            elif e.source is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = e.source.stat().st_size
                with e.source.open("rb") as f:
                    tar.addfile(info, f)


def layer_digest(path: Path) -> str:
    """sha256 of a layer file, remembered next to it (a 5 GiB layer takes long to hash)."""
    memo = path.with_name(path.name + ".sha256")
    if memo.exists() and memo.stat().st_mtime >= path.stat().st_mtime:
        return memo.read_text().strip()
    digest = _digest_file(path)
    memo.write_text(digest)
    return digest


def _digest_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


@dataclass(frozen=True, slots=True)
class _Built:
    """One image's blobs: (digest, bytes or a file) plus its manifest's digest and size."""

    blobs: list[tuple[str, bytes | Path]]
    manifest_digest: str
    manifest_size: int
    platform: dict[str, str]


def _build_manifest(spec: ImageSpec, scratch: Path) -> _Built:
    """The config and manifest of `spec`; its top layer (if any) is written to `scratch`."""
    layers: list[tuple[str, int, Path]] = []
    for layer in spec.layer_files:
        layers.append((layer_digest(layer), layer.stat().st_size, layer))
    if spec.entries or not layers:
        write_layer(spec.entries, scratch)
        layers.append((_digest_file(scratch), scratch.stat().st_size, scratch))
    platform = platform_of(spec.architecture)
    config = {
        **platform,
        "config": {
            "Entrypoint": list(spec.entrypoint) or None,
            "Cmd": list(spec.cmd) or None,
            "Env": [f"{k}={v}" for k, v in sorted(spec.env.items())],
            "User": spec.user,
            "WorkingDir": spec.workdir,
            **({"Labels": dict(sorted(spec.labels.items()))} if spec.labels else {}),
        },
        "rootfs": {"type": "layers", "diff_ids": [d for d, _, _ in layers]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_digest = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": len(config_bytes),
        },
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": n}
            for d, n, _ in layers
        ],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    manifest_digest = "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()
    blobs: list[tuple[str, bytes | Path]] = [(config_digest, config_bytes), (manifest_digest, manifest_bytes)]
    blobs += [(d, p) for d, _, p in layers]
    return _Built(blobs, manifest_digest, len(manifest_bytes), platform)


def _write_layout(
    path: Path, top: Mapping[str, Any], blobs: Sequence[tuple[str, bytes | Path]], omit: frozenset[str]
) -> None:
    """An OCI image-layout tar at `path` (atomically): index.json naming `top`, and every blob once."""
    index = {"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": [dict(top)]}
    tmp = path.with_suffix(f".tmp.{os.getpid()}")
    with tarfile.open(tmp, "w") as tar:
        for name in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        small = {
            "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
            "index.json": json.dumps(index, sort_keys=True).encode(),
        }
        seen: set[str] = set()
        for digest, blob in blobs:
            if isinstance(blob, bytes) and digest not in seen:
                small["blobs/sha256/" + digest.split(":")[1]] = blob
                seen.add(digest)
        for name, data in sorted(small.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        for digest, blob in blobs:
            if isinstance(blob, Path) and digest not in omit and digest not in seen:
                tar.add(blob, arcname="blobs/sha256/" + digest.split(":")[1])
                seen.add(digest)
    tmp.rename(path)


def _annotations(ref: str) -> dict[str, str]:
    return {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref}


def build_archive(
    spec: ImageSpec,
    out_dir: Path,
    tag: str | None = None,
    omit: frozenset[str] = frozenset(),
    ref: str | None = None,
) -> tuple[str, Path]:
    """Write the image as an OCI image-layout tar under out_dir; returns (reference, path).

    The reference is `ref` when given, else `lockstep.local/<name>:<tag>`; without `tag`, 12 hex of
    the manifest digest, so equal inputs give the same reference and any change a new one. Layers
    whose digest is in `omit` (already in the target containerd's content store) are named by the
    manifest but not written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    top = out_dir / f".{spec.name}-top.{os.getpid()}.tar"
    try:
        built = _build_manifest(spec, top)
        ref = ref or f"{REGISTRY}/{spec.name}:{tag or built.manifest_digest.split(':')[1][:12]}"
        descriptor = {
            "mediaType": MANIFEST_TYPE,
            "digest": built.manifest_digest,
            "size": built.manifest_size,
            "platform": built.platform,
            "annotations": _annotations(ref),
        }
        path = out_dir / f"{spec.name}-{ref.rsplit(':', 1)[1]}.tar"
        _write_layout(path, descriptor, built.blobs, omit)
        return ref, path
    finally:
        top.unlink(missing_ok=True)


def build_index(specs: Sequence[ImageSpec], ref: str, path: Path) -> tuple[str, dict[str, str]]:
    """Write one multi-architecture image (an OCI image index over `specs`, one per architecture) as an
    OCI image-layout tar at `path`, named `ref` (what `skopeo copy --all oci-archive:PATH docker://REF`
    pushes). Returns the index digest and architecture -> manifest digest; the manifest of each
    architecture is byte for byte the one build_archive writes for the same spec."""
    archs = [s.architecture for s in specs]
    if len(set(archs)) != len(archs):
        raise ValueError(f"one image per architecture, got {archs}")
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = [path.parent / f".{path.name}-top{i}.{os.getpid()}.tar" for i in range(len(specs))]
    try:
        built = [_build_manifest(spec, top) for spec, top in zip(specs, scratch, strict=True)]
        index = {
            "schemaVersion": 2,
            "mediaType": INDEX_TYPE,
            "manifests": [
                {
                    "mediaType": MANIFEST_TYPE,
                    "digest": b.manifest_digest,
                    "size": b.manifest_size,
                    "platform": b.platform,
                }
                for b in built
            ],
        }
        index_bytes = json.dumps(index, sort_keys=True).encode()
        index_digest = "sha256:" + hashlib.sha256(index_bytes).hexdigest()
        descriptor = {
            "mediaType": INDEX_TYPE,
            "digest": index_digest,
            "size": len(index_bytes),
            "annotations": _annotations(ref),
        }
        blobs: list[tuple[str, bytes | Path]] = [(index_digest, index_bytes)]
        for b in built:
            blobs += b.blobs
        _write_layout(path, descriptor, blobs, frozenset())
        return index_digest, {b.platform["architecture"]: b.manifest_digest for b in built}
    finally:
        for top in scratch:
            top.unlink(missing_ok=True)


def read_index(path: Path) -> dict[str, Any]:
    """The top descriptor of an OCI archive and, for an index, its platforms: {"ref", "mediaType",
    "architectures"} (what the operator's image-architecture rule is checked against in tests)."""
    with tarfile.open(path) as tar:

        def blob(digest: str) -> dict[str, Any]:
            member = tar.extractfile("blobs/sha256/" + digest.split(":")[1])
            assert member is not None
            return dict(json.load(member))

        member = tar.extractfile("index.json")
        assert member is not None
        top = json.load(member)["manifests"][0]
        if top["mediaType"] == INDEX_TYPE:
            archs = [m["platform"]["architecture"] for m in blob(top["digest"])["manifests"]]
        else:
            archs = [blob(blob(top["digest"])["config"]["digest"])["architecture"]]
    return {
        "ref": top.get("annotations", {}).get("org.opencontainers.image.ref.name", ""),
        "mediaType": top["mediaType"],
        "architectures": archs,
    }


def pause_image(pause_binary: Path) -> ImageSpec:
    """The pod sandbox image: only the static pause binary (e2e/controlplane/node/pause)."""
    return ImageSpec(name="pause", entries=[Entry("pause", source=pause_binary)], entrypoint=["/pause"])


def busybox_image(busybox_binary: Path) -> ImageSpec:
    """A tiny userland for tests of the node itself: Debian's static busybox with a link per applet
    (sh, wget with TLS through ssl_client, nslookup, httpd, nc, ...)."""
    listed = subprocess.run([str(busybox_binary), "--list"], capture_output=True, text=True, check=True)
    applets = sorted(set(listed.stdout.split()) - {"busybox"})
    entries = [Entry("bin"), Entry("bin/busybox", source=busybox_binary), Entry("tmp", mode=0o1777)]
    entries += [Entry(f"bin/{a}", link="busybox", mode=0o777) for a in applets if "/" not in a]
    return ImageSpec(name="busybox", entries=entries, cmd=["sh"], env={"PATH": "/bin"})


def unpack(path: Path, arch: str, dest: Path) -> dict[str, Any]:
    """Unpack `arch`'s image of an OCI archive (single image or index) into the rootfs `dest`, layer by
    layer (no whiteouts: the images built here have none); returns its config."""
    with tarfile.open(path) as tar:

        def blob(digest: str) -> tarfile.ExFileObject:
            member = tar.extractfile("blobs/sha256/" + digest.split(":")[1])
            assert member is not None
            return member

        member = tar.extractfile("index.json")
        assert member is not None
        top = json.load(member)["manifests"][0]
        if top["mediaType"] == INDEX_TYPE:
            entries = json.load(blob(top["digest"]))["manifests"]
            found = [m for m in entries if m["platform"]["architecture"] == arch]
            if not found:
                raise ValueError(f"{path} has no {arch} image")
            top = found[0]
        manifest = json.load(blob(top["digest"]))
        config = dict(json.load(blob(manifest["config"]["digest"])))
        if config["architecture"] != arch:
            raise ValueError(f"{path} holds a {config['architecture']} image, not {arch}")
        dest.mkdir(parents=True, exist_ok=True)
        for layer in manifest["layers"]:
            with tarfile.open(fileobj=blob(layer["digest"]), mode="r|") as layer_tar:
                layer_tar.extractall(dest, filter="tar")
    return config


QEMU = {"arm64": "qemu-aarch64-static", "amd64": "qemu-x86_64-static"}
"""User-mode emulators (Debian's qemu-user-static) for an image of another architecture."""


def run_entry(
    root: Path, arch: str, config: Mapping[str, Any], argv: Sequence[str], timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run argv in an unpacked image (chroot, the image's user and env). An image of another
    architecture runs under qemu-user without binfmt_misc (nothing on the host changes): the
    emulator is copied into the rootfs and argv[0] must be an executable path (a script's
    interpreter, not the script: its children would not be emulated)."""
    env = {"PATH": "/usr/bin:/bin"}
    for item in config["config"].get("Env") or []:
        key, _, value = item.partition("=")
        env[key] = value
    cmd = list(argv)
    machine = {"x86_64": "amd64", "aarch64": "arm64"}[os.uname().machine]
    if arch != machine:
        emulator = shutil.which(QEMU[arch])
        if emulator is None:
            raise RuntimeError(f"{QEMU[arch]} is missing: run `bash e2e/controlplane/node/deps.sh` (as root)")
        shutil.copy(emulator, root / "usr" / "bin" / QEMU[arch])
        cmd = [f"/usr/bin/{QEMU[arch]}", *cmd]
    user = config["config"].get("User") or "0:0"
    return subprocess.run(
        ["chroot", f"--userspec={user}", str(root), *cmd],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd="/",
    )
