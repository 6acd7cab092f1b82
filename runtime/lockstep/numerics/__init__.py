"""Numerics both sides of the loop must share bit for bit: exact kernels, the quantizer, the recipe.

Why it exists: two of the seed's equalities are numerical. Same logprobs (true on-policy, seed §4.3)
needs the engine and the trainer to run one computation (`kernels`, installed by `exact`); same
weights under low precision (seed §6) needs one quantizer (`quant`) and one list of BF16 exceptions
(`recipe`) used at every stage. docs/true-on-policy.md and docs/precision.md tell the story.

Who calls it: lockstep.engine, lockstep.train, lockstep.weights, `lockstep precision-check`.
"""
