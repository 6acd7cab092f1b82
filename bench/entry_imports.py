"""Modules each process entry point imports, against a baseline tree measured in the same run.

Why it exists: a trainer rank (`lockstep trainer --serve` under torchrun) should load the trainer and
what it trains with, not the driver or the reference engine (pyproject's import contracts enforce the
package boundaries; this counts what they cost). For each entry module it imports it in a fresh
interpreter and counts the `lockstep.*` modules and all modules in sys.modules, for this tree and for
a baseline revision extracted with `git archive` (default: the commit before the progress reporter
moved below both processes), then prints the ratio.

Run:   .venv/bin/python bench/entry_imports.py [--baseline REV] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = (
    "lockstep.cli.trainer",
    "lockstep.cli.launch",
    "lockstep.cli.engine",
    "lockstep.cli.sessions",
    "lockstep.cli.driver",
    "lockstep.cli.run",
    "lockstep.cli.validate",
)
PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
ours = [n for n in sys.modules if n == "lockstep" or n.startswith("lockstep.")]
print(json.dumps({"lockstep": len(ours), "all": len(sys.modules),
    "driver": any(n.startswith("lockstep.driver") for n in ours),
    "engine": any(n.startswith("lockstep.engine") for n in ours), "torch": "torch" in sys.modules}))
"""


def count(tree: Path, module: str) -> dict[str, object]:
    """Import `module` from `tree` (its runtime/ and operator/ first on sys.path) in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": f"{tree}/runtime:{tree}/operator:{tree}"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, module], env=env, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def extract(rev: str, dest: Path) -> Path:
    """The runtime and operator packages of `rev`, unpacked into dest."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "runtime/lockstep", "operator/lockstep_operator"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="4bcaa60", help="git revision to compare with")
    ap.add_argument("--out", type=Path, default=None, help="write a results .md into this directory")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = extract(args.baseline, Path(tmp))
        for m in ENTRIES:
            before, after = count(base, m), count(ROOT, m)
            rows.append((m, before, after))
    head = "| entry module | lockstep modules before | after | ratio | all modules before | after | driver / engine after |"
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- |"]
    for m, b, a in rows:
        ratio = int(a["lockstep"]) / int(b["lockstep"])  # type: ignore[call-overload]
        lines.append(
            f"| `{m}` | {b['lockstep']} | {a['lockstep']} | {ratio:.2f}x | {b['all']} | {a['all']} "
            f"| {'yes' if a['driver'] else 'no'} / {'yes' if a['engine'] else 'no'} |"
        )
    table = "\n".join(lines)
    print(f"baseline {args.baseline} vs this tree\n{table}")
    if args.out is not None:
        date = datetime.date.today().isoformat()
        path = args.out / f"entry_imports_{date}_cpu.md"
        path.write_text(
            f"# Modules imported per process entry point\n\n`python bench/entry_imports.py --baseline "
            f"{args.baseline} --out bench/results` (each entry imported alone in a fresh interpreter; "
            f"`all` includes torch and the standard library).\n\n{table}\n"
        )
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
