"""Image sizes and build times of `make images` (operator, runtime), amd64 vs arm64, cold vs warm.

Why: the images are built here without Docker by the Dockerfiles' recipe (images/install.sh from
constraints.txt; e2e/controlplane/node/runtime_image.py); what a build costs decides how often CI and
developers rebuild them, and GB300 needs the arm64 variant of each.

What it measures, per image and architecture:
- cold: the dependency layer removed from the cache first, so `install.sh deps` downloads and installs
  every wheel again (pip's own cache is off, as in the Dockerfiles); the Debian base layer is kept
  (--cold-base also rebuilds it);
- warm: every cached layer present: only the package layer (this checkout's lockstep wheel) and the
  archive are written;
- sizes: the base, dependency and package layers and the written single-architecture archive.
Ratios are printed against a baseline measured in the same run: arm64 / amd64 and warm / cold.

    python bench/images.py --image operator                 # both architectures, cold and warm
    python bench/images.py --image runtime --warm-only      # the runtime's cold build downloads ~4 GiB
Results: bench/results/images_<date>_cpu.md (written by hand from the printed table).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.controlplane.node import runtime_image as ri


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def build(name: str, arch: str, *, cold: bool, cold_base: bool, out: Path) -> dict[str, object]:
    recipe = ri.RECIPES[name]
    if cold:
        for layer in (ri.CACHE / "layers").glob(f"deps-{name}-{arch}-*"):
            layer.unlink()
        if cold_base:
            ri.base_layer(arch).unlink()
    t0 = time.monotonic()
    base = ri.base_layer(arch)
    t_base = time.monotonic() - t0
    deps = ri.deps_layer(recipe, arch)
    t_deps = time.monotonic() - t0 - t_base
    _, path = ri.image_archive(name, out, arch=arch)
    total = time.monotonic() - t0
    row = {
        "image": name,
        "arch": arch,
        "mode": "cold" if cold else "warm",
        "seconds": round(total, 1),
        "base_s": round(t_base, 1),
        "deps_s": round(t_deps, 1),
        "package_and_archive_s": round(total - t_base - t_deps, 1),
        "base_bytes": base.stat().st_size,
        "deps_bytes": deps.stat().st_size,
        "archive_bytes": path.stat().st_size,
    }
    row["package_bytes"] = int(row["archive_bytes"]) - int(row["base_bytes"]) - int(row["deps_bytes"])  # type: ignore[call-overload]
    path.unlink()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--image", choices=sorted(ri.RECIPES), default="operator")
    parser.add_argument("--arch", action="append", choices=sorted(ri.ARCHES))
    parser.add_argument("--warm-only", action="store_true", help="skip the cold builds")
    parser.add_argument("--cold-base", action="store_true", help="cold builds also rebuild the Debian base")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    arches = args.arch or ["amd64", "arm64"]
    rows = []
    with tempfile.TemporaryDirectory(dir=ri.CACHE) as tmp:
        for arch in arches:
            if not args.warm_only:
                rows.append(build(args.image, arch, cold=True, cold_base=args.cold_base, out=Path(tmp)))
            rows.append(build(args.image, arch, cold=False, cold_base=False, out=Path(tmp)))
    print(
        "| image | arch | build | total s | base s | deps s | package+archive s | base GiB | deps GiB | package MiB | archive GiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['image']} | {r['arch']} | {r['mode']} | {r['seconds']} | {r['base_s']} | {r['deps_s']} | "
            f"{r['package_and_archive_s']} | {_gib(int(r['base_bytes']))} | {_gib(int(r['deps_bytes']))} | "  # type: ignore[call-overload]
            f"{int(r['package_bytes']) / 2**20:.1f} | {_gib(int(r['archive_bytes']))} |"  # type: ignore[call-overload]
        )
    by = {(r["arch"], r["mode"]): r for r in rows}
    for mode in ("cold", "warm"):
        if ("amd64", mode) in by and ("arm64", mode) in by:
            a, b = by[("amd64", mode)], by[("arm64", mode)]
            print(
                f"{mode}: arm64 / amd64 time {float(b['seconds']) / float(a['seconds']):.2f}x, "  # type: ignore[arg-type]
                f"archive size {int(b['archive_bytes']) / int(a['archive_bytes']):.2f}x"  # type: ignore[call-overload]
            )
    for arch in arches:
        if (arch, "cold") in by:
            ratio = float(by[(arch, "warm")]["seconds"]) / float(by[(arch, "cold")]["seconds"])  # type: ignore[arg-type]
            print(f"{arch}: warm / cold build time {ratio:.3f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
