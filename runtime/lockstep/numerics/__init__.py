"""Numerics both sides of the loop must share bit for bit: exact kernels, the quantizer, the recipe.

Why it exists: two of the equalities of §2 are numerical. Same logprobs (true on-policy, §4.3)
needs the engine and the trainer to run one computation (`kernels`, installed by `exact`); same
weights under low precision (§6) needs one quantizer (`quant`) and one list of BF16 exceptions
(`recipe`) used at every stage. docs/true-on-policy.md and docs/precision.md tell the story.

Who calls it: lockstep.engine, lockstep.train, lockstep.weights, `lockstep precision-check`.
"""
