"""The trainer process: the policy's side of a run (train steps, weight updates, checkpoints).

Why it exists: a job runs two kinds of process, the driver (the loop, lockstep.driver) and the
trainer (one rank per GPU). This package is everything a trainer rank runs, and nothing of the
driver, which it never imports (an import-linter contract): the Trainer protocol both sides share
(protocol.py) and its wire (wire.py), the loop position checkpoints carry (state.py), the trainer's
settings (settings.py), the trainer-side steps in this process (local.py), and for a trainer group
the SPMD of its ranks (spmd.py) and rank 0's command server (server.py). docs/trainer.md explains it.

Who calls it: lockstep.driver (a local trainer, the remote client), lockstep.cli.trainer (rank pods).
"""
