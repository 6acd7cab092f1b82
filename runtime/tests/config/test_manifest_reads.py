"""The manifest is read in one place: lockstep.config (and lockstep.api, which defines it).

Why: a setting read in many places drifts (the learning rate once lived in seven structs). Below the
process entry points nothing takes the whole RLJob and nothing reads `job.spec`: each component takes
its own typed config, built once by lockstep.config. The scan is over the source (ast), so it sees every
function, however it is reached.

Counting (the figure quoted in docs/engineering.md):
    python runtime/tests/config/test_manifest_reads.py
prints the signatures that take an RLJob and the `job.spec` reads outside lockstep.config and lockstep.api.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[2] / "lockstep"

MANIFEST_OWNERS = ("config/", "api/")
"""Packages that read the manifest: lockstep.config maps it to the configs, lockstep.api defines it."""

ENTRY_POINTS = {
    "cli/run.py:execute": "`lockstep run`: loads the manifest and hands it to the driver",
    "cli/trainer.py:serve_rank": "`lockstep trainer --serve`: builds its TrainerConfig, and again with "
    "the operator's transport choice",
    "cli/precision.py:precision_check": "`lockstep precision-check`: builds its RunConfig once",
    "driver/loop.py:run": "the driver's top: builds the RunConfig once (lockstep.config.driver)",
}
"""The functions that may take the whole RLJob, and why: the process entry points, which build configs."""

JOB_NAMES = {"job", "rljob", "manifest"}


def manifest_uses(root: Path = RUNTIME) -> tuple[list[str], list[str]]:
    """(functions taking an RLJob as `file:name`, `job.spec` reads as `file:line`) outside lockstep.config/api."""
    takes, reads = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(MANIFEST_OWNERS):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _takes_job(node):
                takes.append(f"{rel}:{node.name}")
            elif isinstance(node, ast.Attribute) and node.attr == "spec" and _is_job(node.value):
                reads.append(f"{rel}:{node.lineno}")
    return takes, reads


def _takes_job(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    return any(a.annotation is not None and "RLJob" in ast.unparse(a.annotation) for a in args)


def _is_job(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in JOB_NAMES
    return isinstance(node, ast.Attribute) and node.attr in JOB_NAMES


@pytest.fixture(scope="module")
def uses() -> tuple[list[str], list[str]]:
    return manifest_uses()


def test_only_the_entry_points_take_the_rljob(uses: tuple[list[str], list[str]]) -> None:
    takes, _ = uses
    extra = sorted(set(takes) - set(ENTRY_POINTS))
    assert not extra, (
        "these functions take the whole RLJob: give each its own typed config built in lockstep.config "
        "(or, for a new process entry point, add it to ENTRY_POINTS with its reason): " + ", ".join(extra)
    )


def test_nothing_outside_lockstep_config_reads_job_spec(uses: tuple[list[str], list[str]]) -> None:
    _, reads = uses
    assert not reads, (
        "read these manifest fields in lockstep.config (into the component's config) instead: "
        + ", ".join(reads)
    )


def test_the_scan_finds_a_read_and_a_signature(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text(
        "def build(job: RLJob, n: int) -> int:\n    return job.spec.algorithm.batch_size + n\n"
    )
    assert manifest_uses(tmp_path) == (["mod.py:build"], ["mod.py:2"])


if __name__ == "__main__":
    found_takes, found_reads = manifest_uses(Path(sys.argv[1]) if len(sys.argv) > 1 else RUNTIME)
    print(f"signatures taking RLJob: {len(found_takes)}; job.spec reads: {len(found_reads)}")
    print("\n".join(found_takes + found_reads))
