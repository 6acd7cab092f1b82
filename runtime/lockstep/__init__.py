"""Lockstep: RL post-training of LLMs with the rollout engine and the trainer kept on the same policy.

This package is the runtime that every pod runs (engine, trainer ranks, driver, session server) and
that also runs a whole job on one machine (`lockstep run MANIFEST`). Its light subpackage
`lockstep.api` holds the four CRD models and is shared with the operator (`lockstep_operator`); it
never imports torch.
"""

__version__ = "0.1.0"
