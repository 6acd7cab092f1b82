"""The Megatron-core trainer backend: Qwen3 / Qwen3-MoE HF checkpoints as megatron-core GPTModels.

Why it exists: the design's default backend (§8) and its large runs (TP/PP/EP, the distributed optimizer,
offload between steps and optimizer state streamed from disk, §7.1 and §9) behind the
same TrainBackend protocol as FSDP. Never imported by the FSDP backend, and it never imports it.
Modules: config (HF config -> megatron settings), convert (HF <-> Megatron tensors), model (build and
load a rank's model), parallel (process groups), r3 (routing replay), state (offload, streaming),
export (weights to HF names through the bucket pipeline), checkpoint, backend. The package exports the
configs only (config and convert are pure): a process that maps a manifest to a MegatronConfig (every
trainer rank, through lockstep.config.trainer) loads neither the backend's modules nor megatron-core;
MegatronBackend is lockstep.train.megatron.backend's, imported where a job asks for it
(lockstep.train.factory). megatron-core itself is imported inside functions.

Who calls it: lockstep.train.factory (trainer.backend: megatron), tests, bench/.
"""

from lockstep.train.megatron.config import MegatronConfig, ModelShape, ParallelLayout, UnsupportedModel

__all__ = ["MegatronConfig", "ModelShape", "ParallelLayout", "UnsupportedModel"]
