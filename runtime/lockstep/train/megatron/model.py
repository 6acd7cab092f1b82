"""Build this rank's megatron-core GPTModel for an HF checkpoint and load the checkpoint into it.

Why it exists: the backend needs, per rank, the model of its pipeline stage with its TP/EP shards of
the checkpoint's weights. The layer spec is megatron-core's local one (no Transformer Engine, no
Apex), built per layer from the config so dense and MoE layers can mix (`moe_layer_freq`). Weights
are read tensor by tensor from the safetensors files (`HFReader`), converted by
lockstep.train.megatron.convert and copied into the parameters by name; a missing or unexpected tensor
is an error naming it, never a silently random weight. A checkpoint without weights is initialised by
transformers from the seed and converted like a file, so FSDP and Megatron start from the same numbers.

Who calls it: lockstep.train.megatron.backend; tests (on CPU: building and loading work there, only
the forward needs CUDA).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.train.megatron.config import ModelShape, ParallelLayout, transformer_config_kwargs
from lockstep.train.megatron.convert import ShardSpec, canonical_to_local, hf_to_canonical, stage_layers

if TYPE_CHECKING:
    import torch


class HFReader:
    """Lazy access to an HF checkpoint's tensors by name, across `model.safetensors` or its shards."""

    def __init__(self, directory: Path) -> None:
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            weight_map = {}
            from safetensors import safe_open

            for file in sorted(directory.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    weight_map.update(dict.fromkeys(f.keys(), file.name))
        if not weight_map:
            raise FileNotFoundError(f"{directory} holds no safetensors weights")
        self.directory = directory
        self.weight_map = weight_map
        """HF tensor name -> file name."""

    @property
    def names(self) -> set[str]:
        return set(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self.weight_map.get(name)
        if file is None:
            raise KeyError(f"{self.directory}: the checkpoint has no tensor {name!r}")
        with safe_open(str(self.directory / file), framework="pt") as f:
            tensor: torch.Tensor = f.get_tensor(name)
        return tensor


def has_weights(path: Path) -> bool:
    """True when `path` holds safetensors weights (otherwise the model is randomly initialised)."""
    return Path(path).is_dir() and any(Path(path).glob("*.safetensors"))


def random_hf_state(path: Path, seed: int) -> dict[str, torch.Tensor]:
    """transformers' own random init of the checkpoint's config under `seed` (what FSDP starts from)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))  # type: ignore[no-untyped-call]
    return {k: v.detach() for k, v in model.state_dict().items()}


def bind_missing_te_gemm() -> None:
    """Work around megatron-core 0.16.1 without Transformer Engine: every MoE router forward raises.

    Its moe_utils imports `te_general_gemm` inside `try: import transformer_engine` and its `except
    ImportError` branch only sets HAVE_TE = False, so the router's gating linear hits a NameError on
    `if te_general_gemm is not None`. Binding the name to None (the value that code tests for) sends
    the router down its own torch.mm path; with Transformer Engine installed nothing changes.
    """
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", True) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt(shape: ModelShape, layout: ParallelLayout, spec: ShardSpec, *, bf16: bool, cuda: bool) -> Any:
    """This rank's GPTModel (the layers of its stage; embedding on the first, output layer on the last).

    Needs megatron-core's parallel state initialised with `layout`.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if shape.is_moe:
        bind_missing_te_gemm()
    config = TransformerConfig(**transformer_config_kwargs(shape, layout, bf16=bf16, cuda=cuda))
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    theta = shape.rope_theta
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_positions,
        pre_process=spec.pp_rank == 0,
        post_process=spec.pp_rank == spec.pp_size - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(theta) if float(theta).is_integer() else theta,  # typed int upstream
    )


def local_weights(
    shape: ModelShape, path: Path, spec: ShardSpec, *, seed: int = 0
) -> dict[str, torch.Tensor]:
    """This rank's local state dict from the checkpoint at `path` (random HF init when it has no weights)."""
    get: Callable[[str], torch.Tensor]
    if has_weights(path):
        reader = HFReader(path)
        get, names = reader.get, reader.names
    else:
        state = random_hf_state(path, seed)
        get, names = state.__getitem__, set(state)
    layers = stage_layers(shape, spec.pp_rank, spec.pp_size)
    return canonical_to_local(shape, hf_to_canonical(shape, get, names, layers), spec)


def load_into(model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Copy `weights` into the model's parameters by local name (cast to each parameter's dtype).

    Every parameter must be given and every given tensor must be a parameter, with the same shape.
    """
    import torch

    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    extra = sorted(set(weights) - set(params))
    if missing or extra:
        raise KeyError(
            f"megatron weights do not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}"
        )
    with torch.no_grad():
        for name, p in params.items():
            w = weights[name]
            if tuple(w.shape) != tuple(p.shape):
                raise ValueError(
                    f"{name}: checkpoint shard has shape {tuple(w.shape)}, the model's is {tuple(p.shape)}"
                )
            p.copy_(w.to(p.dtype))
