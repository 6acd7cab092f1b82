"""The LoRA side of the engine contract: how an adapter version is named and described to an engine.

Why it exists: a LoRA job syncs only its adapter, through stock SGLang's routes (/load_lora_adapter,
/load_lora_adapter_from_tensors, /unload_lora_adapter) and samples with it by naming it in /generate's
`lora_path`. SGLang never replaces the weights behind a loaded name (loading a name twice is refused),
so every version of a job's adapter is loaded under its own name, `<adapter>-v<version>`; a request
that named a version was sampled by exactly that version's weights, which is how per-token versions
stay exact on an engine many jobs share (the engine's own weight_version belongs to its base model).
The trainer side (lockstep.weights.adapter) loads and unloads these names, the rollout side
(lockstep.rollout.adapter) sends them; both meet here.

Who calls it: lockstep.weights.adapter, lockstep.rollout.adapter, lockstep.cli.unload_adapter, tests.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from lockstep.serving.client import EngineClient, EngineError

_SERVED = re.compile(r"^(?P<adapter>.+)-v(?P<version>\d+)$")


def served_name(adapter: str, version: int) -> str:
    """The engine name of `adapter` at weight `version` (pure)."""
    if version < 0:
        raise ValueError(f"adapter version {version}: must be >= 0")
    return f"{adapter}-v{version}"


def parse_served_name(name: str) -> tuple[str, int] | None:
    """(adapter, version) of a served name, None when it is not one (pure)."""
    m = _SERVED.fullmatch(name)
    return (m["adapter"], int(m["version"])) if m else None


def versions_of(adapter: str, loaded: Iterable[str]) -> list[str]:
    """The names among `loaded` that belong to `adapter`: its versions `<adapter>-v<n>`, and `adapter`
    itself (pure). `a-v3` belongs to `a`, never to `a-v`; other adapters' names are left out."""
    return sorted(n for n in loaded if n == adapter or (parse_served_name(n) or ("", 0))[0] == adapter)


async def unload_versions(client: EngineClient, adapter: str) -> list[str]:
    """Unload every loaded name of `adapter` from one engine (GET /v1/models, then stock SGLang's
    POST /unload_lora_adapter for each, which waits for the requests using it); returns the names. A
    refused unload of a name the engine no longer lists (unloaded by someone else meanwhile) is no
    error; any other refusal raises EngineError."""
    names = versions_of(adapter, (await client.list_models()).adapters())
    for name in names:
        try:
            await client.unload_lora_adapter(name)
        except EngineError:  # the job's own trainer may have unloaded it meanwhile (its close)
            if name in (await client.list_models()).adapters():
                raise
    return names


def adapter_config(
    shapes: Mapping[str, Iterable[int]], *, alpha: int, dropout: float = 0.0, base: str = ""
) -> dict[str, Any]:
    """A peft adapter_config.json for adapter tensors of these names and shapes (pure): r from the
    lora_A shapes ([r, in]), target_modules the leaf module names, as peft and SGLang both read it.
    Raises ValueError when the tensors are not one LoRA adapter of a single rank."""
    ranks, targets = set(), set()
    for name, shape in shapes.items():
        if ".lora_A." in name:
            ranks.add(int(next(iter(shape))))
            targets.add(name.split(".lora_A.", 1)[0].rsplit(".", 1)[-1])
        elif ".lora_B." not in name:
            raise ValueError(f"adapter tensor {name!r} is not a peft LoRA weight (lora_A / lora_B)")
    if len(ranks) != 1:
        raise ValueError(f"adapter tensors have ranks {sorted(ranks)}; one adapter has one rank")
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": ranks.pop(),
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": base or None,
    }
