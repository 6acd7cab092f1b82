"""Where the installed SGLang package is, for the tests that read SGLang's own code as their oracle.

Why it exists: `importlib.util.find_spec("sglang")` alone is not a test for SGLang being installed.
pytest puts runtime/tests on sys.path, and this tree's own `runtime/tests/sglang/` folder (the contract
tests, no `__init__.py`) is then an importable namespace package named `sglang`: where the pinned wheel
is absent, find_spec returns that folder and the oracle tests errored reading `srt/...` files from it
instead of skipping. A namespace package has no origin; the real package has its `__init__.py`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def sglang_package_dir() -> Path | None:
    """The installed sglang package's directory, or None where only a namespace folder is found."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent
