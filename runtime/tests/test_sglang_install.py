"""The SGLang oracle tests skip where SGLang is not installed, even though this test tree has a `sglang/`
folder that Python imports as a namespace package (sglang_install.py says why that matters)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from sglang_install import sglang_package_dir


@pytest.fixture
def only_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """sys.path is just tmp_path (no site-packages), and no sglang is imported yet."""
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


def test_a_namespace_folder_named_sglang_is_not_sglang(only_on_path: Path) -> None:
    (only_on_path / "sglang").mkdir()  # like runtime/tests/sglang: test files, no __init__.py
    assert sglang_package_dir() is None


def test_the_installed_package_is_found(only_on_path: Path) -> None:
    package = only_on_path / "sglang"
    package.mkdir()
    (package / "__init__.py").write_text("")
    assert sglang_package_dir() == package
