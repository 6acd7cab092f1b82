"""The Megatron-core trainer backend: Qwen3 / Qwen3-MoE HF checkpoints as megatron-core GPTModels.

Why it exists: the design card's default backend and the seed's large runs (TP/PP/EP, the distributed
optimizer, offload between steps and optimizer state streamed from disk, seed §7.1 and §9) behind the
same TrainBackend protocol as FSDP. Never imported by the FSDP backend, and it never imports it.
Modules: config (HF config -> megatron settings), convert (HF <-> Megatron tensors), model (build and
load a rank's model), parallel (process groups), r3 (routing replay), state (offload, streaming),
export (weights to HF names through the bucket pipeline), checkpoint, backend. megatron-core itself is
imported lazily (inside functions), so config and convert work without it.

Who calls it: lockstep.train.factory (trainer.backend: megatron), tests, bench/.
"""

from lockstep.train.megatron.backend import MegatronBackend, MegatronConfig
from lockstep.train.megatron.config import ModelShape, ParallelLayout, UnsupportedModel

__all__ = ["MegatronBackend", "MegatronConfig", "ModelShape", "ParallelLayout", "UnsupportedModel"]
