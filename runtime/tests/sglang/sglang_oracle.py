"""SGLang's own code as the oracle of the contract tests: its ServerArgs parser, routes and request structs.

Why it exists: the operator renders SGLang commands and the runtime speaks SGLang's HTTP API without
ever importing SGLang (an import-linter contract), so drift shows only against the real thing. The
pinned wheel (scripts/setup.sh, --no-deps) is read here three ways: `parse_server_args` runs SGLang's
own argument parser; `served_routes` reads the routes and methods from the installed
entrypoints/http_server.py; `request_struct` rebuilds, from the installed managers/io_struct.py, the
request struct a route's handler takes, as a msgspec Struct that refuses unknown fields, so a body
the runtime sends is converted exactly as SGLang's server would check it. io_struct.py itself cannot
be imported here (its imports reach torchvision and CUDA kernels), so it is read as source.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.metadata
import importlib.util
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from lockstep_operator.resources.sglang import SGLANG_VERSION
from sglang_install import sglang_package_dir

# Installed with the pinned sglang by scripts/setup.sh; without it (an operator-only install) skip.
msgspec = pytest.importorskip("msgspec", reason="installed with the pinned sglang by scripts/setup.sh")


def require_pinned_sglang() -> None:
    """Skip when SGLang is not installed (an operator-only install); fail on another version than the pin."""
    if sglang_package_dir() is None:
        pytest.skip("sglang is not installed: run scripts/setup.sh (it installs the pinned wheel for tests)")
    installed = importlib.metadata.version("sglang")
    assert installed == SGLANG_VERSION, (
        f"sglang {installed} is installed but the contract is pinned to {SGLANG_VERSION}: "
        "run scripts/setup.sh, or move the pin (SGLANG_VERSION in lockstep/api/profiles.py, which scripts/setup.sh reads) and re-check"
    )


def source(relative: str) -> Path:
    """A file of the installed sglang package, e.g. `srt/entrypoints/http_server.py`."""
    installed = sglang_package_dir()
    assert installed is not None, "sglang is not installed: call require_pinned_sglang() first"
    return installed / relative


class FlagError(AssertionError):
    """SGLang's parser refused a rendered command; the message is argparse's."""


def parse_server_args(argv: list[str]) -> Any:
    """SGLang's ServerArgs for a `sglang.launch_server` argument list, parsed by SGLang's own parser."""
    from sglang.srt.server_args import prepare_server_args

    try:
        return prepare_server_args(argv)
    except SystemExit as e:  # argparse reports to stderr and exits 2
        raise FlagError(
            f"SGLang {SGLANG_VERSION} refuses the command {argv}: exit {e.code} (see stderr)"
        ) from e


# -- routes --------------------------------------------------------------------------------------


@functools.cache
def _http_server() -> ast.Module:
    return ast.parse(source("srt/entrypoints/http_server.py").read_text())


def _route(decorator: ast.expr) -> tuple[str, set[str]] | None:
    """(path, methods) of `@app.get("/x")`, `@app.post(...)`, `@app.api_route("/x", methods=[...])`."""
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)):
        return None
    if not (isinstance(decorator.func.value, ast.Name) and decorator.func.value.id == "app"):
        return None
    if not decorator.args or not isinstance(decorator.args[0], ast.Constant):
        return None
    path, kind = str(decorator.args[0].value), decorator.func.attr
    if kind in ("get", "post", "put", "delete"):
        return path, {kind.upper()}
    if kind == "api_route":
        methods = next((k.value for k in decorator.keywords if k.arg == "methods"), None)
        if isinstance(methods, ast.List):
            return path, {str(m.value) for m in methods.elts if isinstance(m, ast.Constant)}
    return None


@functools.cache
def served_routes() -> dict[str, tuple[set[str], ast.AsyncFunctionDef | ast.FunctionDef]]:
    """path -> (methods, handler) of every route SGLang's HTTP server declares."""
    out: dict[str, tuple[set[str], ast.AsyncFunctionDef | ast.FunctionDef]] = {}
    for node in ast.walk(_http_server()):
        if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            for dec in node.decorator_list:
                found = _route(dec)
                if found:
                    path, methods = found
                    out.setdefault(path, (set(), node))[0].update(methods)
    return out


def mounted_routes() -> set[tuple[str, str]]:
    """(method, path) SGLang serves outside its route decorators: GET /metrics, which
    add_prometheus_middleware mounts (utils/common.py) when the HTTP server calls it (--enable-metrics)."""
    calls = "add_prometheus_middleware(app)" in source("srt/entrypoints/http_server.py").read_text()
    mounts = 'Mount("/metrics"' in source("srt/utils/common.py").read_text()
    return {("GET", "/metrics")} if calls and mounts else set()


def _annotation_names(node: ast.expr | None) -> list[str]:
    return [n.id for n in ast.walk(node) if isinstance(n, ast.Name)] if node is not None else []


def handler_struct(path: str) -> str | None:
    """The io_struct class the handler of `path` takes as its body (`obj: X`), None when it takes none."""
    _, handler = served_routes()[path]
    for arg in handler.args.args:
        if arg.arg == "obj":
            names = [
                n for n in _annotation_names(arg.annotation) if n not in ("Annotated", "Optional", "Body")
            ]
            return names[0] if names else None
    return None


# -- request structs -----------------------------------------------------------------------------


@functools.cache
def _io_struct_classes() -> dict[str, ast.ClassDef]:
    tree = ast.parse(source("srt/managers/io_struct.py").read_text())
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


class _Marker:
    """Stands for SGLang-internal annotation markers (Base64Bytes(), PlainValidator(...))."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass


_NAMESPACE: dict[str, Any] = {
    **{
        name: getattr(typing, name)
        for name in ("Any", "Dict", "List", "Literal", "Optional", "Tuple", "Union")
    },
    "Annotated": typing.Annotated,
    "Base64Bytes": _Marker,
    "PlainValidator": _Marker,
}


def _annotation(node: ast.expr) -> Any:
    """The annotation as a type; names SGLang defines elsewhere (its own structs) become Any."""
    try:
        value = eval(compile(ast.Expression(node), "<io_struct>", "eval"), dict(_NAMESPACE))
    except NameError:
        return Any
    return value if not isinstance(value, _Marker) else Any


def _fields(cls: ast.ClassDef) -> list[tuple[str, Any, bool]]:
    """(name, type, required) of a class's annotated fields, its io_struct bases' first."""
    classes = _io_struct_classes()
    out: list[tuple[str, Any, bool]] = []
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out += _fields(classes[base.id])
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out.append((stmt.target.id, _annotation(stmt.annotation), stmt.value is None))
    return out


def _checkable(t: Any) -> Any:
    """`t`, or Any where msgspec cannot check it (a union of several list types: the name is still checked)."""
    try:
        msgspec.json.Decoder(t)
    except TypeError:
        return Any
    return t


@functools.cache
def request_struct(name: str) -> type[msgspec.Struct]:
    """io_struct class `name` rebuilt as a msgspec Struct with the same field names, types and
    required fields, refusing unknown fields."""
    fields = [(f, _checkable(t), required) for f, t, required in _fields(_io_struct_classes()[name])]
    spec: list[tuple[str, Any] | tuple[str, Any, Any]] = [
        (f, t) if required else (f, t, None) for f, t, required in fields
    ]
    return msgspec.defstruct(name, spec, kw_only=True, forbid_unknown_fields=True)


def check_body(name: str, body: Mapping[str, Any] | None) -> None:
    """Convert `body` to io_struct `name` as SGLang's server would; raises msgspec.ValidationError
    naming an unknown, missing or mistyped field."""
    msgspec.convert(dict(body or {}), request_struct(name), strict=False)


def generate_contract_error(body: Mapping[str, Any]) -> str | None:
    """SGLang's own /generate contract gate (sglang.srt.entrypoints.api_contract)."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error as gate

    result: str | None = gate(dict(body))
    return result


# -- checkpoint quantization -----------------------------------------------------------------------


@functools.cache
def _modelopt_parser() -> Any:
    """SGLang's own `ModelConfig._parse_modelopt_quant_config` (and the module function it calls),
    compiled from the installed model_config.py: the module cannot be imported here (its package
    imports torchvision), and the two functions need nothing else."""
    tree = ast.parse(source("srt/configs/model_config.py").read_text())
    wanted = {"unwrap_modelopt_quantization_config", "_parse_modelopt_quant_config"}
    found = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name in wanted]
    assert {f.name for f in found} == wanted, "SGLang's model_config.py moved its ModelOpt parser"
    namespace: dict[str, Any] = {"Optional": typing.Optional}
    exec(compile(ast.Module(body=found, type_ignores=[]), "sglang-model-config", "exec"), namespace)
    return namespace["_parse_modelopt_quant_config"]


def checkpoint_quant_method(config: Mapping[str, Any]) -> str:
    """The quant_method SGLang's ModelConfig resolves from a checkpoint's config.json (the first
    branch of `_parse_quant_hf_config`: a ModelOpt config is parsed into its method), which
    `_verify_quantization` then compares with --quantization."""
    qc = dict(config["quantization_config"])
    if "quant_method" not in qc or qc["quant_method"] == "modelopt":
        parsed = _modelopt_parser()(None, {"quantization": qc})
        if parsed:
            qc.update(parsed)
    return str(qc["quant_method"]).lower()


@functools.cache
def _layer_skipped() -> Any:
    """SGLang's own `is_layer_skipped` (quantization/utils.py: which layers a quantized checkpoint's
    ignored list leaves unquantized, refusing fused layers quantized in part), compiled from source
    (the module's imports reach CUDA kernels)."""
    tree = ast.parse(source("srt/layers/quantization/utils.py").read_text())
    wanted = {"_module_path_match", "is_layer_skipped", "_FALLBACK_FUSED_SHARDS"}
    body: list[ast.stmt] = [
        node
        for node in tree.body
        if (isinstance(node, ast.FunctionDef) and node.name in wanted)
        or (
            isinstance(node, ast.AnnAssign | ast.Assign)
            and wanted
            & {
                getattr(t, "id", "")
                for t in ([node.target] if isinstance(node, ast.AnnAssign) else node.targets)
            }
        )
    ]
    import types

    namespace: dict[str, Any] = {"MappingProxyType": types.MappingProxyType, "Mapping": Mapping,
                                 "List": list, "typing": typing}  # fmt: skip
    exec(compile(ast.Module(body=body, type_ignores=[]), "sglang-quant-utils", "exec"), namespace)
    return namespace["is_layer_skipped"]


def is_layer_skipped(prefix: str, ignored: list[str]) -> bool:
    """Whether SGLang leaves the layer at `prefix` (its fused name, e.g. `...self_attn.qkv_proj`)
    unquantized under `ignored`; raises ValueError where SGLang does (a fused layer quantized in part)."""
    return bool(_layer_skipped()(prefix, ignored))


# -- routed experts (FusedMoE) -------------------------------------------------------------------


def _function_from(relative: str, name: str, owner: str | None = None, extra: tuple[str, ...] = ()) -> Any:
    """A function of an installed sglang module compiled from its source (decorators dropped; a
    method of class `owner` as a plain function), with the module-level functions `extra` it calls."""
    import re

    tree = ast.parse(source(relative).read_text())
    scope: list[ast.stmt] = tree.body
    if owner is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner).body
    fn = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.decorator_list = []
    helpers = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in extra]
    namespace: dict[str, Any] = {"List": list, "Tuple": tuple, "Optional": typing.Optional, "re": re,
                                 "lru_cache": functools.lru_cache}  # fmt: skip
    module = ast.Module(body=[*helpers, fn], type_ignores=[])
    exec(compile(ast.fix_missing_locations(module), f"sglang:{relative}", "exec"), namespace)
    return namespace[name]


def expert_params_mapping(num_experts: int) -> list[tuple[str, str, int, str]]:
    """SGLang's FusedMoE.make_expert_params_mapping(gate_proj, down_proj, up_proj, E), as Qwen3-MoE's
    load_weights calls it: (param prefix, checkpoint name part, expert id, shard id)."""
    fn = _function_from("srt/layers/moe/fused_moe_triton/layer.py", "make_expert_params_mapping", "FusedMoE")
    return list(fn(None, "gate_proj", "down_proj", "up_proj", num_experts))


def modelopt_excludes(prefix: str, exclude_modules: list[str]) -> bool:
    """SGLang's ModelOptQuantConfig.is_layer_excluded: whether a ModelOpt checkpoint's
    exclude_modules leave the layer at `prefix` (a FusedMoE's `...mlp.experts`) unquantized."""
    import types

    fn = _function_from(
        "srt/layers/quantization/modelopt_quant.py",
        "is_layer_excluded",
        "ModelOptQuantConfig",
        ("_compile_exclusion_pattern",),
    )
    return bool(fn(types.SimpleNamespace(exclude_modules=exclude_modules), prefix))


def moe_parameter_shapes(relative: str, cls: str, param: str, env: dict[str, Any]) -> list[tuple[int, ...]]:
    """The shapes SGLang's MoE method `cls` creates parameter `param` with, one per create_weights
    branch whose size expressions `env` can evaluate (the positional arguments of the torch.empty /
    ones / zeros / scale_init call that allocates it, read from the installed source)."""
    tree = ast.parse(source(relative).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    variables = {
        call.args[1].id
        for call in ast.walk(node)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
        and call.func.attr == "register_parameter" and len(call.args) == 2
        and isinstance(call.args[0], ast.Constant) and call.args[0].value == param
        and isinstance(call.args[1], ast.Name)
    }  # fmt: skip
    allocators = {"empty", "ones", "zeros", "scale_init"}
    shapes: list[tuple[int, ...]] = []
    for assign in ast.walk(node):
        if not (
            isinstance(assign, ast.Assign)
            and any(getattr(t, "id", None) in variables for t in assign.targets)
        ):
            continue
        for call in ast.walk(assign.value):
            name = (
                getattr(call.func, "attr", getattr(call.func, "id", "")) if isinstance(call, ast.Call) else ""
            )
            if name in allocators:
                # a branch whose sizes need names env lacks (another variant) is not this one
                with contextlib.suppress(NameError, AttributeError, TypeError):
                    shapes.append(tuple(int(eval(compile(ast.Expression(a), "sglang", "eval"), {}, env))
                                        for a in call.args))  # type: ignore[arg-type]  # fmt: skip
                break
    return shapes
