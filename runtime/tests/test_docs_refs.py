"""Every "§N" in the repository resolves to a section of docs/design.md, and no comment or doc cites an
issue number (docs/engineering.md, "Code": a reader of the repository can open the one, not the other).

bench/results/ is left out: each file there is the dated record of one measurement, kept as written.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".go", ".cfg", ".jinja"}
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
ISSUE = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)


def _sources() -> list[Path]:
    out = [ROOT / "Makefile"]
    for top in ("runtime", "operator", "e2e", "bench", "docs", "examples", "scripts", "images", "manifests"):
        for p in (ROOT / top).rglob("*"):
            rel = p.relative_to(ROOT)
            if SKIP_DIRS & set(rel.parts) or rel.parts[:2] == ("bench", "results"):
                continue
            if p.is_file() and p.suffix in SUFFIXES:
                out.append(p)
    return [*out, *ROOT.glob("*.md"), ROOT / "pyproject.toml"]


def _sections() -> set[str]:
    """The section numbers docs/design.md defines: its headings "## §N ..." and "### §N.M ..."."""
    return {m.group(1) for m in re.finditer(r"^#+ §(\d+(?:\.\d+)*)\s", DESIGN.read_text(), re.MULTILINE)}


def test_every_section_reference_resolves_to_the_design_doc() -> None:
    sections = _sections()
    assert {"1", "4.1", "7.2.5", "11"} <= sections, sorted(sections)
    dangling = [
        f"{p.relative_to(ROOT)}:{n}: §{ref}"
        for p in _sources()
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        for ref in SECTION.findall(line)
        if ref not in sections
    ]
    assert not dangling, "no such section in docs/design.md:\n" + "\n".join(dangling)


def test_no_comment_or_doc_cites_an_issue_number() -> None:
    cited = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in _sources()
        if p.name != Path(__file__).name
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if ISSUE.search(line)
    ]
    assert not cited, "say what and why instead of citing an issue:\n" + "\n".join(cited)


def _contract_layers() -> list[set[str]]:
    """The runtime layers of pyproject's import-linter contract, top first, each a set of packages."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["name"].startswith("Runtime layers")]
    return [{p.strip() for p in layer.split("|")} for layer in layers]


def test_engineering_lists_the_runtime_layers_of_the_contract() -> None:
    text = (ROOT / "docs" / "engineering.md").read_text()
    start = text.index("- Runtime layers")
    paragraph = " ".join(text[start : text.index("A lower layer never", start)].split())
    listed = [
        {p.strip() for p in group.split("|")} for group in re.findall(r"`(lockstep\.[^`]+)`", paragraph)
    ]
    assert listed == _contract_layers(), (
        "docs/engineering.md's runtime layers differ from pyproject's contract"
    )


def test_readme_lists_the_runtime_layers_of_the_contract() -> None:
    text = (ROOT / "README.md").read_text()
    table = text[
        text.index("The runtime packages, top layer first") : text.index("| `operator/lockstep_operator`")
    ]
    listed = []
    for row in re.findall(r"^\| (`runtime/lockstep/[^|]+)\|", table, re.MULTILINE):
        names = [Path(n).stem for n in re.findall(r"`([^`]+)`", row)]
        listed.append({f"lockstep.{n}" for n in names})
    assert listed == _contract_layers(), "README's layout table differs from pyproject's runtime layers"
