"""LoRA on the FSDP2 backend: peft adapters on a frozen base, exported and checkpointed alone.

Why it exists: with spec.model.lora the policy is base + a low-rank adapter (§8). peft builds the
adapter layers (`get_peft_model`), so the trainer runs a maintained implementation, not layers of its
own; this module is the glue the backend needs around it:
- `attach` wraps the loaded HF model before FSDP2 shards it: the base parameters are frozen
  (requires_grad False: no gradient, no optimizer state, never written), only `lora_A`/`lora_B` train.
  A target module name that matches nothing in the model fails here, naming spec.model.lora and the
  model's linear layers (peft's own error would name neither).
- `base_tensors` is what `export_base` yields: the frozen base under HF names, which the LoRA
  pre-flight hashes and compares with every engine's /weights_checker checksum.
- `adapter_tensors` is what `export_weights` yields: the adapter's full tensors under peft's saved
  names (`base_model.model.<module>.lora_A.weight`, [r, in]; `lora_B.weight`, [out, r]), the names
  SGLang's /load_lora_adapter_from_tensors and a peft adapter directory both use.
- adapter directories in peft's layout (adapter_config.json + adapter_model.safetensors) are written
  and read by lockstep.models.adapter_dir: `PeftModel.from_pretrained(base, dir)` and SGLang's
  /load_lora_adapter load them as they are.

Who calls it: lockstep.train.fsdp.backend (build, export, checkpoints), lockstep.weights (adapter
directories for the engines), tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lockstep.models.adapter_dir import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    is_adapter_dir,
    load_adapter,
    save_adapter,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "AdapterConfig",
    "is_adapter_dir",
    "load_adapter",
    "save_adapter",
]
PEFT_ADAPTER = "default"
"""The adapter name inside the peft model (peft's default); never part of saved or synced names."""
ALL_LINEAR = "all-linear"


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterConfig:
    """The adapter a LoRA job trains (spec.model.lora), as the trainer and the engines need it."""

    rank: int
    """r: columns of lora_A's output / rows of lora_B's input."""
    alpha: int
    """Scaling numerator: the adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """peft's lora_dropout, applied to the adapter's input in training forwards only."""
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    """Module names peft matches (suffixes such as `q_proj`), or `all-linear`."""
    name: str
    """The adapter's name on the engines (each version loads as `<name>-v<version>`)."""

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha < 1:
            raise ValueError(f"spec.model.lora: rank {self.rank} and alpha {self.alpha} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"spec.model.lora.dropout {self.dropout}: must be in [0, 1)")
        if not self.target_modules:
            raise ValueError("spec.model.lora.targetModules is empty: name modules or use all-linear")

    @property
    def scaling(self) -> float:
        """alpha / rank, the factor on lora_B(lora_A(x))."""
        return self.alpha / self.rank


def linear_modules(model: Any) -> list[str]:
    """Leaf names of the linear layers an adapter can target, sorted (`all-linear` takes all of them
    but the output head, which is named explicitly: `lm_head`)."""
    import torch

    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return sorted(names)


def check_targets(model: Any, targets: Iterable[str]) -> None:
    """Raise ValueError naming spec.model.lora.targetModules when a target matches no linear layer."""
    have = set(linear_modules(model))
    missing = sorted(t for t in targets if t != ALL_LINEAR and t.rsplit(".", 1)[-1] not in have)
    if missing:
        raise ValueError(
            f"spec.model.lora.targetModules {missing}: no such linear module in "
            f"{type(model).__name__}; its linear layers are {sorted(have)} (or use all-linear)"
        )


def attach(model: Any, config: AdapterConfig, *, base_path: str = "") -> Any:
    """Wrap `model` (an HF causal LM) with a fresh peft LoRA adapter; the base is frozen.

    peft initializes lora_A randomly (from torch's RNG) and lora_B to zeros, so base + adapter starts
    exactly equal to the base. Returns the PeftModel.
    """
    from peft import LoraConfig, get_peft_model

    check_targets(model, config.target_modules)
    targets: str | list[str] = list(config.target_modules)
    if ALL_LINEAR in config.target_modules:  # peft's all-linear, plus any module named beside it (lm_head)
        extra = [t for t in config.target_modules if t != ALL_LINEAR]
        decoder = [n for n in linear_modules(model) if n != "lm_head"]
        targets = ALL_LINEAR if not extra else sorted({*decoder, *extra})
    lora = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=targets,
        bias="none",
        base_model_name_or_path=base_path or None,
    )
    peft_model = get_peft_model(model, lora, adapter_name=PEFT_ADAPTER)
    for name, p in peft_model.named_parameters():  # peft freezes the base; make it a guarantee here
        p.requires_grad_(".lora_" in name)
    return peft_model


def hf_model(peft_model: Any) -> Any:
    """The HF causal LM inside a PeftModel (its decoder layers are `.model.layers`)."""
    return peft_model.base_model.model


def is_adapter_key(name: str) -> bool:
    """Whether a state-dict key of the peft model is an adapter tensor."""
    return ".lora_A." in name or ".lora_B." in name


def saved_name(key: str) -> str:
    """peft model state-dict key -> peft's saved name (the adapter name segment dropped)."""
    return key.replace(f".lora_A.{PEFT_ADAPTER}.", ".lora_A.").replace(f".lora_B.{PEFT_ADAPTER}.", ".lora_B.")


def model_key(name: str) -> str:
    """peft's saved name -> the peft model's state-dict key (inverse of saved_name)."""
    return name.replace(".lora_A.", f".lora_A.{PEFT_ADAPTER}.").replace(
        ".lora_B.", f".lora_B.{PEFT_ADAPTER}."
    )


def adapter_tensors(state_dict: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(saved name, full tensor) of every adapter tensor of a (possibly sharded) state dict."""
    for key, value in state_dict.items():
        if is_adapter_key(key):
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            yield saved_name(key), full.detach()


def base_name(key: str) -> str:
    """peft model state-dict key of a base tensor -> its HF name (what the checkpoint and the engines
    call it): `base_model.model.` and a wrapped layer's `.base_layer` dropped."""
    return key.removeprefix("base_model.model.").replace(".base_layer.", ".")


def base_tensors(state_dict: Mapping[str, Any], *, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of every base tensor of a (possibly sharded) peft state dict, adapter
    tensors left out; with `tied` embeddings the output head is left out, as in HF checkpoints."""
    for key, value in state_dict.items():
        if is_adapter_key(key):
            continue
        name = base_name(key)
        if tied and name == "lm_head.weight":
            continue
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        yield name, full.detach()


def adapter_config_dict(peft_model: Any, config: AdapterConfig, *, base_path: str = "") -> dict[str, Any]:
    """adapter_config.json of the adapter (peft's LoraConfig as it saves it), with target_modules as
    the leaf names peft matched (`q_proj`, ...): what peft and SGLang both read."""
    lora = peft_model.peft_config[PEFT_ADAPTER]
    out: dict[str, Any] = json.loads(json.dumps(lora.to_dict(), default=_jsonable))
    out["target_modules"] = sorted({str(t).rsplit(".", 1)[-1] for t in lora.target_modules})
    out["base_model_name_or_path"] = base_path or out.get("base_model_name_or_path")
    out["inference_mode"] = True
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return sorted(value, key=str)
    return str(value)
