"""SGLang's own kernels as the oracle of the GPU tests: its batch-invariant ops and its rotary function,
loaded from the pinned wheel's source files.

Why it exists: stock SGLang cannot run here or on the lent H200 (its sgl-kernel / flashinfer wheels
cannot be carried), and importing `sglang.srt.batch_invariant_ops` as a package pulls in most of
SGLang (torchvision, zmq, CUDA kernels). Two of its files need nothing but torch and triton to
compute: `srt/batch_invariant_ops/batch_invariant_ops.py` (the Triton matmul, log_softmax and mean
that `--enable-deterministic-inference` registers for aten) and
`srt/layers/rotary_embedding/utils.py` (`apply_rotary_emb`). They are executed here from the wheel's
own source, byte for byte; only their imports of SGLang's environment probes are answered by
`_PROBES`, which give what SGLang's own probes give on a CUDA machine without DeepGEMM
(`ENABLE_JIT_DEEPGEMM` False: deep_gemm is not installed; the SM count; the "CUDA" dispatch key).

Where the source comes from: `LOCKSTEP_SGLANG_SOURCE` (a directory holding the package's `srt/...`
files, e.g. unpacked from the pinned wheel for the device machine), else the installed sglang package
(scripts/setup.sh installs the pin). Neither: the test skips.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sglang_install import sglang_package_dir

if TYPE_CHECKING:
    from collections.abc import Iterator


def root() -> Path:
    """The sglang package directory the oracle files are read from (skips when there is none)."""
    env = os.environ.get("LOCKSTEP_SGLANG_SOURCE")
    if env:
        return Path(env)
    installed = sglang_package_dir()
    if installed is None:
        pytest.skip(
            "no SGLang source: install the pinned sglang (scripts/setup.sh) or set LOCKSTEP_SGLANG_SOURCE"
        )
    return installed


def _probes() -> dict[str, dict[str, Any]]:
    import torch

    def get_bool_env_var(name: str, default: str = "false") -> bool:
        return os.getenv(name, default).lower() in ("true", "1")

    def calc_diff(x: Any, y: Any) -> Any:
        x, y = x.double(), y.double()
        return 1 - 2 * (x * y).sum() / (x * x + y * y).sum()

    return {
        "sglang.srt.layers.deep_gemm_wrapper.configurer": {"ENABLE_JIT_DEEPGEMM": False},
        "sglang.srt.utils": {
            "is_npu": lambda: False,
            "is_cpu": lambda: False,
            "cpu_has_amx_support": lambda: False,
            "get_compiler_backend": lambda: "inductor",
        },
        "sglang.srt.utils.common": {
            "calc_diff": calc_diff,
            "get_bool_env_var": get_bool_env_var,
            "get_device_core_count": lambda device_id=0: (
                torch.cuda.get_device_properties(device_id).multi_processor_count
            ),
            "get_dispatch_device_backend": lambda: "CUDA",
        },
    }


@contextmanager
def _probe_modules() -> Iterator[None]:
    """SGLang's probe modules in sys.modules while one oracle file executes; the real entries after."""
    names = ["sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.deep_gemm_wrapper", *_probes()]
    saved = {n: sys.modules.get(n) for n in names}
    try:
        for n in names:
            sys.modules[n] = types.ModuleType(n)
        for n, attrs in _probes().items():
            for k, v in attrs.items():
                setattr(sys.modules[n], k, v)
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


_LOADED: dict[str, Any] = {}


def load(relative: str) -> Any:
    """Execute one of SGLang's files (e.g. `srt/layers/rotary_embedding/utils.py`) as a private module."""
    if relative not in _LOADED:
        pytest.importorskip("triton", reason="SGLang's kernels are Triton kernels")
        path = root() / relative
        name = "_sglang_oracle_" + relative.replace("/", "_").removesuffix(".py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # triton reads the kernels' source through the module
        with _probe_modules():
            spec.loader.exec_module(module)
        _LOADED[relative] = module
    return _LOADED[relative]


def batch_invariant_ops() -> Any:
    """SGLang's `batch_invariant_ops` module (enable_batch_invariant_mode, ...), DeepGEMM off."""
    os.environ["SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_DEEPGEMM"] = "0"
    return load("srt/batch_invariant_ops/batch_invariant_ops.py")


def apply_rotary_emb() -> Any:
    """SGLang's `apply_rotary_emb(x, cos, sin, is_neox_style)`."""
    return load("srt/layers/rotary_embedding/utils.py").apply_rotary_emb
