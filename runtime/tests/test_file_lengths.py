"""No long file: a Python file under runtime/ or operator/ has at most MAX_LINES lines, or is a listed exception.

Why: a file past a few hundred lines holds more than one concern, and a reader cannot keep it in view;
docs/engineering.md ("Code") states the rule. A file over it is split by concern (lockstep.api's
sections, the engine's scheduler and weights). An exception's number is its ceiling: it may shrink,
not grow, and it goes once the file is within the rule.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("runtime", "operator")
MAX_LINES = 800
"""Most lines of one Python file."""

SKIP_DIRS = {".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}

EXCEPTIONS: dict[str, tuple[int, str]] = {}
"""Path from the repository root -> (its most lines, why it stays over MAX_LINES)."""


def line_counts(root: Path = ROOT) -> dict[str, int]:
    """Lines of every Python file of the trees, by path from `root`."""
    counts = {}
    for tree in TREES:
        for path in (root / tree).rglob("*.py"):
            rel = path.relative_to(root)
            if not SKIP_DIRS & set(rel.parts):
                counts[rel.as_posix()] = len(path.read_text().splitlines())
    return counts


def long_files(counts: dict[str, int]) -> dict[str, int]:
    """The files over MAX_LINES, or over their listed exception (pure)."""
    return {p: n for p, n in counts.items() if n > EXCEPTIONS.get(p, (MAX_LINES, ""))[0]}


def test_no_file_is_over_the_line_rule() -> None:
    long = long_files(line_counts())
    assert not long, (
        f"these files are over {MAX_LINES} lines (or over their listed exception): split them by "
        "concern, or list a real exception with its reason in EXCEPTIONS: "
        + ", ".join(f"{p} ({n})" for p, n in sorted(long.items()))
    )


def test_every_exception_is_still_needed() -> None:
    counts = line_counts()
    stale = [p for p in EXCEPTIONS if counts.get(p, 0) <= MAX_LINES]
    assert not stale, "these files are within the rule now (or gone): remove their exceptions: " + ", ".join(
        stale
    )


def test_the_count_sees_a_long_file(tmp_path: Path) -> None:
    (tmp_path / "runtime" / "pkg").mkdir(parents=True)
    (tmp_path / "runtime" / "pkg" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "operator").mkdir()
    (tmp_path / "operator" / "short.py").write_text("x = 1\n" * MAX_LINES)
    counts = line_counts(tmp_path)
    assert counts == {"runtime/pkg/long.py": MAX_LINES + 1, "operator/short.py": MAX_LINES}
    assert long_files(counts) == {"runtime/pkg/long.py": MAX_LINES + 1}


if __name__ == "__main__":
    for path, n in sorted(line_counts().items(), key=lambda kv: -kv[1])[:20]:
        print(n, path)
