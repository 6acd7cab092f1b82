"""Backend-independent training math: advantages, policy losses, mismatch correction, packing.

Why it exists: the FSDP2 backend and a future Megatron backend must compute the same loss on the same
tokens. Everything here is a pure function of tensors (or of Groups, for packing), golden-tested in
runtime/tests/train.

Who calls it: lockstep.train.fsdp (inside train_step), lockstep.driver (builds batches and losses).
"""
