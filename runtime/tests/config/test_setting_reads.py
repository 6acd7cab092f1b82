"""Each setting of the manifest is read in exactly one function of lockstep.config.

Why: test_manifest_reads keeps the manifest inside lockstep.config; inside it, a setting read by two
functions is mapped twice (the learning rate once lived in seven structs), and the two mappings drift.
A function that needs a value another config already holds takes it from that config (run_config's
teachers take the engines' numerics) or from the one function that reads it (batch_shape, job_steps).

The scan is over the source (ast), per top-level function of runtime/lockstep/config: an attribute
chain from `job.spec`, from a local name bound to such a chain (`alg = job.spec.algorithm`) or from a
parameter annotated with a section's model (`spec: SandboxSpec`) is a read of the field it ends on. A
setting is a field whose value is not a section (a model, or a list or map of models): reading a
section to pass it on or to test it for None is not a setting's read. Items of a list of sections
(`for t in opd.teachers`) are not followed.

Listing the settings and the functions that read them:
    python runtime/tests/config/test_setting_reads.py
"""

from __future__ import annotations

import ast
import sys
import typing
from pathlib import Path

from lockstep.api import RLJobSpec
from pydantic import BaseModel

CONFIG = Path(__file__).resolve().parents[2] / "lockstep" / "config"


def _models(annotation: object) -> list[type[BaseModel]]:
    """The models inside an annotation (`X | None`, `list[X]`, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _section_paths(
    model: type[BaseModel] = RLJobSpec, path: tuple[str, ...] = ()
) -> dict[str, list[tuple[str, ...]]]:
    """Section model name -> the paths under spec where it sits."""
    out: dict[str, list[tuple[str, ...]]] = {}
    for name, field in model.model_fields.items():
        for sub in _models(field.annotation):
            out.setdefault(sub.__name__, []).append((*path, name))
            for k, v in _section_paths(sub, (*path, name)).items():
                out.setdefault(k, []).extend(v)
    return out


def _setting(path: tuple[str, ...]) -> str | None:
    """The setting a chain under spec reads (cut at the first name that is no field), or None for a section."""
    model: type[BaseModel] | None = RLJobSpec
    for i, name in enumerate(path):
        if model is None or name not in model.model_fields:
            return ".".join(path[:i]) if model is None else None
        annotation = model.model_fields[name].annotation
        section = _models(annotation)
        nested = typing.get_origin(annotation) in (list, dict)
        model = section[0] if section and not nested else None
        if nested and section:
            return None  # a list or map of sections
    return ".".join(path) if model is None else None


def setting_reads(root: Path = CONFIG) -> dict[str, set[str]]:
    """Setting (spec path, snake_case) -> the `file:function`s of lockstep.config that read it."""
    sections = {k: v[0] for k, v in _section_paths().items() if len(v) == 1}
    reads: dict[str, set[str]] = {}
    for path in sorted(root.glob("*.py")):
        for fn in ast.parse(path.read_text(), str(path)).body:
            if isinstance(fn, ast.FunctionDef):
                for setting in _function_reads(fn, sections):
                    reads.setdefault(setting, set()).add(f"{path.name}:{fn.name}")
    return reads


def _function_reads(fn: ast.FunctionDef, sections: dict[str, tuple[str, ...]]) -> set[str]:
    aliases = {
        a.arg: sections[ast.unparse(a.annotation)]
        for a in [*fn.args.args, *fn.args.kwonlyargs]
        if a.annotation is not None and ast.unparse(a.annotation) in sections
    }

    def resolve(node: ast.expr) -> tuple[str, ...] | None:
        names: list[str] = []
        while isinstance(node, ast.Attribute):
            names.insert(0, node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id == "job" and names[:1] == ["spec"]:
            return tuple(names[1:])
        if isinstance(node, ast.Name) and node.id in aliases:
            return aliases[node.id] + tuple(names)
        return None

    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            bound = resolve(node.value)
            if bound is not None:
                aliases[node.targets[0].id] = bound
    parents = {child: node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and not isinstance(parents.get(node), ast.Attribute):
            chain = resolve(node)
            setting = _setting(chain) if chain else None
            if setting:
                out.add(setting)
    return out


def test_each_setting_is_read_in_one_function_of_lockstep_config() -> None:
    twice = {s: sorted(fns) for s, fns in setting_reads().items() if len(fns) > 1}
    assert not twice, (
        "these settings are read from the manifest in more than one function of lockstep.config: read each "
        "in one function and take its value from that config (or that function) elsewhere: "
        + "; ".join(f"spec.{s} in {', '.join(fns)}" for s, fns in sorted(twice.items()))
    )


def test_the_scan_sees_the_settings_of_the_configs() -> None:
    reads = setting_reads()
    assert reads["algorithm.learning_rate"] == {"trainer.py:trainer_settings"}
    assert reads["agent.sandbox.image"] == {"driver.py:sandbox_config"}  # through `spec: SandboxSpec`
    assert "algorithm.opd" not in reads and "rollout.session" not in reads  # sections, not settings


def test_the_scan_finds_a_setting_read_twice(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "def one(job):\n    alg = job.spec.algorithm\n    return alg.batch_size, alg.kl.coef\n\n\n"
        "def two(job):\n    return job.spec.algorithm.batch_size, job.spec.rollout.sampling.top_p.real\n\n\n"
        "def three(job):\n    return job.spec.algorithm.kl if job.spec.algorithm.opd else None\n"
    )
    assert setting_reads(tmp_path) == {
        "algorithm.batch_size": {"a.py:one", "a.py:two"},
        "algorithm.kl.coef": {"a.py:one"},
        "rollout.sampling.top_p": {"a.py:two"},
    }


if __name__ == "__main__":
    for setting, functions in sorted(
        setting_reads(Path(sys.argv[1]) if len(sys.argv) > 1 else CONFIG).items()
    ):
        print("**" if len(functions) > 1 else "  ", f"spec.{setting}", ", ".join(sorted(functions)))
