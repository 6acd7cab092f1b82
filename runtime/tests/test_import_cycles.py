"""No import cycle between our modules (lockstep and lockstep_operator), and none hidden in a function.

Why: a cycle hidden behind a function-local import is a layering bug waiting for its first top-level
import. The graph is grimp's (the library import-linter builds its contracts on), which records every
import statement of a module: top level, inside functions and under TYPE_CHECKING alike; a second test
keeps our own modules imported at the top, where a cycle cannot hide.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

PACKAGES = ("lockstep", "lockstep_operator")


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) per strongly connected set of modules, sorted; [] when acyclic."""
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    cycles = []
    for component in _strongly_connected(modules, edges):
        if len(component) > 1 or component[0] in edges[component[0]]:
            cycles.append(_cycle_through(component, edges))
    return sorted(cycles)


def _strongly_connected(modules: list[str], edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the runtime's import graph is deep enough to matter)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            targets = edges.get(node, [])
            if i < len(targets):
                work.append((node, i + 1))
                nxt = targets[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def _cycle_through(component: list[str], edges: dict[str, list[str]]) -> list[str]:
    """The shortest cycle from the component's first module back to itself (breadth-first)."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in edges[node]:
            if nxt == start:
                return [*paths[node], start]
            if nxt in members and nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    raise AssertionError(f"{start} is in a strongly connected set but no cycle returns to it")


def test_no_import_cycle_between_our_modules() -> None:
    cycles = import_cycles(grimp.build_graph(*PACKAGES, cache_dir=None))
    assert not cycles, "import cycles (break each by moving what both need to a lower module):\n" + "\n".join(
        " -> ".join(c) for c in cycles
    )


@pytest.mark.parametrize(
    ("imports", "expected"),
    [
        pytest.param([("a", "b"), ("b", "c")], [], id="chain"),
        pytest.param([("a", "b"), ("b", "a")], [["a", "b", "a"]], id="pair"),
        pytest.param([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")], [["a", "b", "c", "a"]], id="triangle"),
        pytest.param(
            [("x.a", "x.b"), ("x.b", "x.a"), ("y", "y")], [["x.a", "x.b", "x.a"], ["y", "y"]], id="two"
        ),
    ],
)
def test_the_detector_names_each_cycle(imports: list[tuple[str, str]], expected: list[list[str]]) -> None:
    graph = grimp.ImportGraph()
    for importer, imported in imports:
        graph.add_import(importer=importer, imported=imported)
    assert import_cycles(graph) == expected


ALLOWED = {
    # kopf registers the handlers when their module is imported: only at `lockstep-operator` start.
    ("lockstep_operator/__main__.py", "lockstep_operator.handlers"),
    ("lockstep_operator/reconcile/rljob.py", "lockstep.api.rljob"),
    # megatron-core is an optional extra: the factory imports its backend only when a job asks for it
    # (the package itself exports only the configs, which every trainer rank maps the manifest to).
    ("lockstep/train/factory.py", "lockstep.train.megatron"),
    ("lockstep/train/factory.py", "lockstep.train.megatron.backend"),
    # the bucket planning is pure and torch-free; only a fused expert tensor needs torch to split.
    ("lockstep/weights/pipeline.py", "lockstep.numerics"),
}
"""The function-local imports of our modules that stay, each with its reason."""


def function_local_imports(*roots: Path) -> set[tuple[str, str]]:
    """(file relative to its root's parent, module) for every import of lockstep / lockstep_operator
    inside a function body: the place a cycle hides."""
    found = set()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text())
            for fn in ast.walk(tree):
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom):
                        names = ["." * node.level + (node.module or "")]
                    elif isinstance(node, ast.Import):
                        names = [a.name for a in node.names]
                    else:
                        continue
                    for name in names:
                        if name.startswith(".") or name.split(".")[0] in PACKAGES:
                            found.add((path.relative_to(root.parent).as_posix(), name))
    return found


def test_our_modules_are_imported_at_the_top() -> None:
    repo = Path(__file__).resolve().parents[2]
    found = function_local_imports(repo / "runtime" / "lockstep", repo / "operator" / "lockstep_operator")
    extra = sorted(found - ALLOWED)
    assert not extra, (
        "import these at the top of the module (a function-local import of our own code hides a cycle; "
        "only heavy optional third-party packages such as torch may be imported lazily): "
        + ", ".join(f"{f}: {m}" for f, m in extra)
    )


def test_a_function_local_import_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "lockstep"
    pkg.mkdir()
    (pkg / "m.py").write_text("import os\n\ndef f():\n    import json\n    from lockstep.api import RLJob\n")
    assert function_local_imports(pkg) == {("lockstep/m.py", "lockstep.api")}
