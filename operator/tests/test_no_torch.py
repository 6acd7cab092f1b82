"""The operator image has no torch: importing the operator (and its handlers) must not import it."""

from __future__ import annotations

import subprocess
import sys


def test_operator_imports_leave_torch_out() -> None:
    code = (
        "import sys\n"
        "import lockstep_operator, lockstep_operator.handlers, lockstep_operator.__main__\n"
        "bad = sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the operator imported {out.stdout.strip()}"
