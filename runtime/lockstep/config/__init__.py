"""Typed component configs built from an RLJob: the one place the runtime reads the manifest.

Why it exists: a setting read in many places drifts (the learning rate once lived in seven structs).
Each component of the runtime (backends, weight transports, the trainer, the engines, the rollout,
the session server, the loops) takes its own keyword-only config, a frozen dataclass declared next to
the component; the functions of this package build every one of them from the manifest, once per
process, and nothing below reads `job.spec`. The driver process builds its RunConfig
(lockstep.config.driver, which includes the trainer's); a trainer rank builds only the trainer's
(lockstep.config.trainer), so it never imports the driver's side.

Adding a setting: declare the field (with its attribute docstring) on the config of the component
that uses it, read it from the manifest in exactly one function here, and test that mapping in
runtime/tests/config/.

Who calls it: lockstep.driver (RunConfig), lockstep.cli.trainer (TrainerConfig), lockstep.cli.precision.
"""
