"""The operator's policies: named pure functions of what a reconcile observed, one small file each.

Each file holds one decision (when a job failed, when it succeeded, its phase, each condition, when the
trainer gang restarts, which engines roll, how many replicas a pool wants) next to a table test in
operator/tests/policy/. No I/O and no clock reads: the time is passed in. The reconciles observe,
ask these functions, act, and write the status they compose (reconcile/status.py).
"""
