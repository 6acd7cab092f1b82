"""lockstep_operator: the kopf operator that reconciles RLJob, RolloutPool, TrainerGroup and WeightChannel.

It imports `lockstep.api` for the CRD models and never torch (the operator image has no torch).
"""
