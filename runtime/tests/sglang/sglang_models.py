"""SGLang's own model classes and weight loaders, built on CPU at a chosen tensor-parallel rank.

Why it exists: P2P cuts every full tensor the way an SGLang engine rank holds it (lockstep.weights.
reshard). The definition of that layout is SGLang's code: each model's `load_weights` (its stacked
and expert parameter mappings) and the weight loaders of its layers (QKVParallelLinear,
MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, FusedMoE). This module builds
the pinned wheel's model classes here, without GPUs or process groups, as SGLang itself builds a model
embedded in another process: `create_context(ServerArgs)` + `use_context`, with the rank stated through
SGLang's `get_parallel().override(...)` and group handles that carry only a rank and a size (weight
loading reads nothing else). Python packages SGLang imports for other purposes (vision, tokenizers of
other models, GGUF, vLLM's CPU rotary op) are not installed with the pinned wheel (--no-deps); they are
answered by empty stand-ins at import time only, so none of their code runs in what is tested.

Who calls it: runtime/tests/sglang/test_p2p_layouts.py.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from sglang_install import sglang_package_dir

ABSENT = frozenset(
    {
        "tvm_ffi",
        "torchvision",
        "sentencepiece",
        "einops",
        "compressed_tensors",
        "gguf",
        "partial_json_parser",
        "vllm",
    }
)
"""Top-level packages the pinned wheel's import graph reaches that weight loading never uses."""


class _Meta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Absent,), {})


class _Absent(metaclass=_Meta):
    """Anything read from a stand-in package: a class (it may be subclassed) whose attributes are too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Absent,), {})


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Absent,), {})


class _Finder:
    """Answers imports of ABSENT packages (only when they are really not installed)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in ABSENT:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)  # type: ignore[arg-type]
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def import_sglang() -> None:
    """Make the pinned wheel's model modules importable here (skips without the wheel)."""
    if sglang_package_dir() is None:
        pytest.skip("sglang is not installed: run scripts/setup.sh (it installs the pinned wheel for tests)")
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        missing = {n for n in ABSENT if importlib.util.find_spec(n) is None}
        if missing:
            finder = _Finder()
            sys.meta_path.append(finder)  # after the real finders: an installed package always wins


class _Group:
    """A process group as SGLang's layers read it during construction and weight loading."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank_in_group, self.world_size, self.rank, self.local_rank = rank, size, rank, rank
        self.ranks = list(range(size))
        self.first_rank, self.last_rank = 0, size - 1
        self.is_first_rank, self.is_last_rank = rank == 0, rank == size - 1
        self.cpu_group = self.device_group = None


@contextlib.contextmanager
def sglang_rank(model_dir: Path, tp_rank: int, tp_size: int, ep_size: int = 1) -> Iterator[None]:
    """SGLang's runtime context for TP rank `tp_rank` of `tp_size` (MoE: ep_size expert-parallel
    groups of tp_size / ep_size MoE TP ranks), for the HF checkpoint config in `model_dir`."""
    from sglang.srt.runtime_context import create_context, get_parallel, use_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=str(model_dir), tp_size=tp_size, ep_size=ep_size, device="cpu",
                      skip_tokenizer_init=True)  # fmt: skip
    # Resolving a DSA model's arguments reads the GPU generation (for its kernel choice): answer a Hopper's.
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        context = create_context(args, role="scheduler")
    moe_tp = tp_size // ep_size
    ranks = {
        "tp_rank": tp_rank, "attn_tp_rank": tp_rank, "moe_tp_rank": tp_rank % moe_tp,
        "moe_ep_rank": tp_rank // moe_tp, "moe_dp_rank": 0, "pp_rank": 0,
        "tp_group": _Group(tp_rank, tp_size), "attn_tp_group": _Group(tp_rank, tp_size),
        "moe_tp_group": _Group(tp_rank % moe_tp, moe_tp), "moe_ep_group": _Group(tp_rank // moe_tp, ep_size),
        "pp_group": _Group(0, 1),
    }  # fmt: skip
    with use_context(context), get_parallel().override(**ranks):
        yield


def sglang_model(model_dir: Path) -> Any:
    """SGLang's model class for the checkpoint's architecture, constructed in the current rank context."""
    import torch
    from sglang.srt.models.registry import ModelRegistry
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    cls, _ = ModelRegistry.resolve_model_cls(config.architectures)
    # SGLang's CPU rotary embedding supports only deepseek_yarn scaling (MLA and the DSA indexer ask
    # for plain RoPE); it holds no weights, so an empty module stands in for it while the model is built.
    with mock.patch("sglang.srt.layers.rotary_embedding.factory.get_rope_cpu",
                    side_effect=lambda *a, **k: torch.nn.Module()):  # fmt: skip
        return cls(config=config)
