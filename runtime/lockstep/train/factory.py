"""Build the trainer backend a config names (trainer.backend: fsdp or megatron).

Why it exists: the two backends are swappable behind lockstep.train.backend.TrainBackend and never
import each other; the only place that knows both is this factory, so a call site (the local run, a
trainer rank) builds whichever the config holds in one line. megatron-core is an optional extra
(`pip install lockstep[megatron]`): it is imported only when a MegatronConfig asks for it. The configs
themselves are built from the manifest by lockstep.config.trainer.

Who calls it: lockstep.driver.policy (a local run), lockstep.trainer.server (the trainer ranks),
lockstep.trainer.standalone (`lockstep trainer` without --serve).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from lockstep.train.fsdp import FSDPBackend, FSDPConfig

if TYPE_CHECKING:
    from lockstep.train.backend import BackendConfig, TrainBackend


def build_backend(config: BackendConfig, model_dir: Path) -> TrainBackend:
    """The backend `config` describes (an FSDPConfig or a MegatronConfig), for the checkpoint at
    `model_dir` (one rank of it)."""
    config = dataclasses.replace(config, model_path=Path(model_dir))
    if isinstance(config, FSDPConfig):
        return FSDPBackend(config)
    try:
        from lockstep.train.megatron import MegatronConfig
        from lockstep.train.megatron.backend import MegatronBackend
    except ImportError as e:  # the optional extra is not installed
        raise ValueError(
            f"spec.trainer.backend megatron needs megatron-core ({e}): install lockstep[megatron], or set "
            "trainer.backend to fsdp"
        ) from e
    if not isinstance(config, MegatronConfig):
        raise TypeError(f"no backend takes a {type(config).__name__}; use FSDPConfig or MegatronConfig")
    return MegatronBackend(config)
