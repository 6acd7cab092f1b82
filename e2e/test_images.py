"""Lockstep's images as `make images` builds them: one recipe (images/install.sh from constraints.txt),
multi-architecture (amd64 and arm64 for GB300's Grace), and every image's entry command runs in it.

The amd64 images also run as pods on the real node (e2e/test_realnode.py); here each image is unpacked
into a root filesystem and its entry check runs in it with chroot as the image's user, the arm64 one
under qemu-user emulation (node/images.py run_entry: no binfmt_misc, nothing on the host changes).
Needs root (chroot, mmdebstrap), like the real node.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from lockstep.api.images import image_ref

from e2e.controlplane.node import runtime_image
from e2e.controlplane.node.images import read_index, run_entry, unpack

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mmdebstrap") is None or shutil.which("qemu-aarch64-static") is None,
    reason="building images needs root, mmdebstrap and qemu-user-static (bash e2e/controlplane/node/deps.sh)",
)


@pytest.mark.timeout(1800)
def test_the_operator_image_is_one_index_for_amd64_and_arm64_and_its_entry_runs_in_both(
    tmp_path: Path,
) -> None:
    ref, archive = runtime_image.multiarch_archive("operator", tmp_path)
    assert ref == image_ref("operator")  # versioned with the package, what the manifests name
    index = read_index(archive)
    assert index == {
        "ref": ref,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "architectures": ["amd64", "arm64"],
    }
    check = list(runtime_image.RECIPES["operator"].entry_check)
    check[0] = "/opt/lockstep/bin/python"  # run_entry needs the path of the interpreter
    for arch, machine in (("amd64", "x86_64"), ("arm64", "aarch64")):
        root = tmp_path / arch
        config = unpack(archive, arch, root)
        assert config["architecture"] == arch
        assert config["config"]["User"] == "65532:65532"
        assert config["config"]["Cmd"] == ["lockstep-operator"]
        # The entry command's interpreter line names the image's own Python, as in the Dockerfile's.
        entry = (root / "opt/lockstep/bin/lockstep-operator").read_text()
        assert entry.startswith("#!/opt/lockstep/bin/python\n"), entry
        proc = run_entry(
            root, arch, config, [*check[:2], check[2] + "; import platform; print(platform.machine())"]
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.split() == ["ok", machine], proc.stdout
        # The same wheels pip would install on that machine: compiled extensions are arm64 ELF files.
        site = root / "opt/lockstep/lib/python3.11/site-packages"
        so = next(site.glob("pydantic_core/_pydantic_core*.so"))
        elf_machine = so.read_bytes()[18:20]
        assert elf_machine == {"amd64": b"\x3e\x00", "arm64": b"\xb7\x00"}[arch], (so, elf_machine)


def test_an_image_of_one_architecture_is_refused_for_another(tmp_path: Path) -> None:
    """unpack (and so a test) never runs an amd64 image as arm64: the config's architecture is checked."""
    _ref, archive = runtime_image.image_archive("operator", tmp_path, arch="amd64")
    assert read_index(archive)["architectures"] == ["amd64"]
    with pytest.raises(ValueError, match="holds a amd64 image, not arm64"):
        unpack(archive, "arm64", tmp_path / "root")


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("LOCKSTEP_ARM64_RUNTIME") != "1",
    reason="builds the 6 GiB arm64 runtime image and imports torch under emulation (~40 min, ~13 GiB of "
    "disk): set LOCKSTEP_ARM64_RUNTIME=1",
)
@pytest.mark.timeout(3600)
def test_the_arm64_runtime_image_imports_the_default_trainer_backend_under_emulation(tmp_path: Path) -> None:
    """GB300's trainer ranks run the arm64 runtime image: its entry imports lockstep's CLI and
    megatron-core (the default trainer backend) with the aarch64 CUDA torch from PyPI."""
    _ref, archive = runtime_image.image_archive("runtime", tmp_path, arch="arm64")
    root = tmp_path / "root"
    config = unpack(archive, "arm64", root)
    archive.unlink()
    check = list(runtime_image.RECIPES["runtime"].entry_check)
    check[0] = "/opt/lockstep/bin/python"
    proc = run_entry(root, "arm64", config, check, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok 2."), proc.stdout


@pytest.mark.timeout(900)
def test_onbase_keeps_every_version_the_base_image_has(tmp_path: Path) -> None:
    """install.sh `onbase` (the SGLang-based images): what the base environment has stays at its
    version, the rest comes from constraints.txt, and the commands work. A venv stands in for SGLang's
    image, with a pydantic other than constraints.txt's."""
    import subprocess
    import sys

    venv = tmp_path / "base"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "-q", "--disable-pip-version-check"]
    pins = (runtime_image.REPO / "constraints.txt").read_text()
    pinned = next(line.split("==")[1] for line in pins.splitlines() if line.startswith("pydantic=="))
    # As in an image build: nothing of this checkout on the path (the lanes' PYTHONPATH would show pip
    # an installed lockstep).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PIP": " ".join(pip)}
    onbase = ["sh", str(runtime_image.INSTALL), "onbase", ""]
    # A base version lockstep cannot run with (kubernetes 37 needs pydantic >= 2.14.2): refused, the
    # base left as it was.
    subprocess.run([*pip, "install", "pydantic==2.11.7"], check=True)
    proc = subprocess.run(onbase, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "ResolutionImpossible" in proc.stderr, proc.stderr[-3000:]
    show = subprocess.run([*pip[:3], "show", "pydantic"], capture_output=True, text=True, check=True).stdout
    assert "Version: 2.11.7" in show
    other = "2.14.3" if pinned != "2.14.3" else "2.14.2"
    subprocess.run([*pip, "install", f"pydantic=={other}"], check=True)
    proc = subprocess.run(onbase, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    show = subprocess.run(
        [*pip[:3], "show", "pydantic", "kopf"], capture_output=True, text=True, check=True
    ).stdout
    assert f"Version: {other}" in show  # the base's version, not constraints.txt's
    kopf_pin = next(line.split("==")[1] for line in pins.splitlines() if line.startswith("kopf=="))
    assert f"Version: {kopf_pin}" in show  # what the base lacked: constraints.txt's version
    ran = subprocess.run(
        [str(venv / "bin" / "lockstep"), "--help"], capture_output=True, text=True, check=False
    )
    assert ran.returncode == 0 and "usage: lockstep" in ran.stdout, ran.stderr[-2000:]
