"""On-policy distillation on the rollout side: route each sample to one teacher, score its exact tokens.

Why it exists: §8.1. The student writes; a served teacher scores every token it wrote (the row's
own IDs, never generated again), and the scores travel with the sample to the trainer, which folds them
into the advantage (lockstep.train.common.opd). Modules: `config` (the typed settings built from
spec.algorithm.opd), `candidates` (the selected-support estimate over a candidate set, pure),
`scorer` (routing, the teacher and student scoring requests, the per-step report), `tokenizers` (the
check at start that teacher and student map every token ID to the same string).

Who calls it: lockstep.driver (builds the scorer, runs the check, reports), lockstep.rollout.generate
(Rollout.run_sample scores each finished sample).
"""
