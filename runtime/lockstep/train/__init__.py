"""The trainer: turns complete groups into optimizer steps and hands back HF-named weights.

Why it exists: the RL loop needs one place that (1) recomputes logprobs of exactly the rollout's
token IDs, (2) applies an RL loss with mismatch correction, (3) exports gathered weights in HF names
for the weight transports, and (4) checkpoints for resume. `backend.TrainBackend` is the swap point;
`fsdp/` is the FSDP2 implementation, a future `megatron/` sits beside it and never imports `fsdp/`.
`common/` holds the backend-independent pure functions (advantages, losses, mismatch correction,
packing of groups into padded tensors).

Who calls it: lockstep.driver (the loop and the SFT warm start) and the `lockstep trainer` pods.
"""
