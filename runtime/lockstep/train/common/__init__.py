"""Backend-independent training math: advantages, policy losses, mismatch correction, packing, R3.

Why it exists: the FSDP2 backend and a future Megatron backend must compute the same loss on the same
tokens. Everything here is a pure function of tensors (or of Groups, for packing), golden-tested in
runtime/tests/train. `r3` decodes the rollout's MoE routing (R3 payloads) and replays it in HF MoE
routers.

Who calls it: lockstep.train.fsdp (inside train_step), lockstep.driver (builds batches and losses).
"""
