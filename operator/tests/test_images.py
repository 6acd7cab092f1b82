"""The images' one recipe and one source of truth for versions (pure: reads images/, pyproject.toml,
constraints.txt). The builds themselves run in e2e/test_images.py and e2e/test_realnode.py."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import lockstep
import pytest
from lockstep.api.images import IMAGES, image_ref, version
from lockstep.api.profiles import SGLANG_VERSION
from lockstep.api.rljob import TrainerBackend, TrainerSpec
from lockstep_operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[2]
IMAGES_DIR = REPO / "images"


def _pin(name: str) -> str:
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.lower().startswith(f"{name}=="):
            return line.split("==", 1)[1]
    raise AssertionError(f"constraints.txt pins no {name}")


def test_every_image_has_a_dockerfile_and_each_installs_through_the_one_install_step() -> None:
    for name in IMAGES:
        text = (IMAGES_DIR / f"{name}.Dockerfile").read_text()
        steps = [line for line in text.splitlines() if "pip install" in line and not line.startswith("#")]
        runs = re.findall(r"images/install\.sh (deps|package|onbase)", text)
        assert runs, f"{name}.Dockerfile does not run images/install.sh"
        # Only the FA3 kernel build (not a Python dependency of lockstep) may call pip itself.
        assert all("--no-build-isolation ." in s for s in steps), (name, steps)
        assert "constraints.txt" in text, f"{name}.Dockerfile does not copy constraints.txt"


def test_the_runtime_image_holds_the_default_trainer_backend() -> None:
    """trainer.backend defaults to megatron, so the image of the trainer ranks installs megatron-core."""
    from e2e.controlplane.node.runtime_image import RECIPES

    assert TrainerSpec().backend is TrainerBackend.MEGATRON
    extras = re.findall(r"install\.sh deps (\S+) ", (IMAGES_DIR / "runtime.Dockerfile").read_text())
    assert extras == [RECIPES["runtime"].extras], "the Dockerfile and the build here install other extras"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {e for extra in extras[0].split(",") for e in project["optional-dependencies"][extra]}
    assert any(r.startswith("megatron-core") for r in wanted)
    assert "megatron.core" in " ".join(RECIPES["runtime"].entry_check)


def test_sglang_has_one_version_the_engine_images_tag_and_the_oracle_pin() -> None:
    assert _pin("sglang") == SGLANG_VERSION
    for name in ("engine", "trainer-sglang"):
        text = (IMAGES_DIR / f"{name}.Dockerfile").read_text()
        assert re.findall(r"^ARG SGLANG_TAG=(\S+)$", text, flags=re.M) == [f"v{SGLANG_VERSION}"], name
        assert "FROM lmsysorg/sglang:${SGLANG_TAG}" in text
        assert "latest" not in text


def test_image_references_are_versioned_with_the_package() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lockstep.__version__"}
    assert version() == lockstep.__version__
    settings = OperatorSettings()
    assert settings.runtime_image == image_ref("runtime") == f"ghcr.io/lockstep/lockstep-runtime:{version()}"
    assert settings.engine_image == image_ref("engine")
    with pytest.raises(ValueError, match="unknown image 'nope'"):
        image_ref("nope")


def test_every_debian_based_image_installs_the_one_package_list() -> None:
    for name in ("operator", "runtime"):
        text = (IMAGES_DIR / f"{name}.Dockerfile").read_text()
        assert "FROM debian:bookworm-slim" in text
        assert "images/base-packages.txt" in text
