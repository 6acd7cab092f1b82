"""Loading an HF-layout checkpoint as a causal LM, the same way on every side.

Why it exists: the engine and the trainer must run one computation. transformers >= 5.25 loads a
model "kernelized" from the Hugging Face `kernels` hub by default (`use_kernels=None` means on): layers
get forwards fetched at run time, and `.train()` / `.eval()` kernelize them again, overwriting any
forward installed after the load (our true on-policy kernels). Lockstep downloads nothing at run time
and installs its own kernels, so every load goes through here with the hub kernels off.

Who calls it: lockstep.engine.core (the reference engine), lockstep.train.fsdp (the trainer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_causal_lm(path: str | Path, **kwargs: Any) -> Any:
    """AutoModelForCausalLM.from_pretrained(path, **kwargs) with the hub kernels off."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, use_kernels=False, **kwargs)
