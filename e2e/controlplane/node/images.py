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
import subprocess
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

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


def build_archive(
    spec: ImageSpec, out_dir: Path, tag: str | None = None, omit: frozenset[str] = frozenset()
) -> tuple[str, Path]:
    """Write the image as an OCI image-layout tar under out_dir; returns (reference, path).

    The reference is `lockstep.local/<name>:<tag>`; without `tag`, 12 hex of the manifest digest, so
    equal inputs give the same reference and any change a new one. Layers whose digest is in `omit`
    (already in the target containerd's content store) are named by the manifest but not written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    top = out_dir / f".{spec.name}-top.{os.getpid()}.tar"
    layers: list[tuple[str, int, Path]] = []
    try:
        for layer in spec.layer_files:
            layers.append((layer_digest(layer), layer.stat().st_size, layer))
        if spec.entries or not layers:
            write_layer(spec.entries, top)
            layers.append((_digest_file(top), top.stat().st_size, top))
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Entrypoint": list(spec.entrypoint) or None,
                "Cmd": list(spec.cmd) or None,
                "Env": [f"{k}={v}" for k, v in sorted(spec.env.items())],
                "User": spec.user,
                "WorkingDir": spec.workdir,
            },
            "rootfs": {"type": "layers", "diff_ids": [d for d, _, _ in layers]},
        }
        config_bytes = json.dumps(config, sort_keys=True).encode()
        config_digest = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
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
        ref = f"{REGISTRY}/{spec.name}:{tag or manifest_digest.split(':')[1][:12]}"
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": len(manifest_bytes),
                    "annotations": {
                        "io.containerd.image.name": ref,
                        "org.opencontainers.image.ref.name": ref,
                    },
                }
            ],
        }
        path = out_dir / f"{spec.name}-{ref.rsplit(':', 1)[1]}.tar"
        tmp = path.with_suffix(f".tmp.{os.getpid()}")
        with tarfile.open(tmp, "w") as tar:
            for name in ("blobs", "blobs/sha256"):
                info = tarfile.TarInfo(name)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            small = {
                "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
                "index.json": json.dumps(index, sort_keys=True).encode(),
                "blobs/sha256/" + config_digest.split(":")[1]: config_bytes,
                "blobs/sha256/" + manifest_digest.split(":")[1]: manifest_bytes,
            }
            for name, data in sorted(small.items()):
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
            for digest, _, layer_path in layers:
                if digest not in omit:
                    tar.add(layer_path, arcname="blobs/sha256/" + digest.split(":")[1])
        tmp.rename(path)
        return ref, path
    finally:
        top.unlink(missing_ok=True)


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
