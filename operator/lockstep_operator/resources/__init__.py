"""Pure builders of the child manifests the operator applies (pods, services, pod groups, config maps).

Each builder takes explicit keyword arguments and returns a plain manifest dict; nothing here talks to
the cluster, so every builder is golden-tested (operator/tests/golden/). Called by
`lockstep_operator.reconcile.*`, which derives the arguments from the parsed lockstep.api models.
"""
