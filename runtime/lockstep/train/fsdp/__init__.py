"""The FSDP2 trainer backend (torch.distributed.fsdp.fully_shard) on HF transformers causal LMs.

Why it exists: the default trainer of Lockstep; gloo on CPU (one process is the local default), NCCL
on CUDA (ranks from torchrun env). Never imported by a Megatron backend, and vice versa.

Who calls it: lockstep.train.factory builds `FSDPBackend` (a local run's, lockstep.driver.policy); `lockstep trainer` runs it per rank.
"""

from lockstep.train.fsdp.backend import FSDPBackend, FSDPConfig

__all__ = ["FSDPBackend", "FSDPConfig"]
