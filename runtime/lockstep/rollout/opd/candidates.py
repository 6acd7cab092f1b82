"""The served-teacher candidate-set estimate of OPD's per-position log-ratio (§8.1), pure.

Why it exists: sampled-token OPD compares the two models on one token per position (unbiased, noisy).
With served scores of more tokens, position t compares them on a candidate set C_t:
    d_t = sum_{v in C_t} w_t(v) * (log p_t(v) - log q_t(v))
with C_t the student's top-K (S_t), the teacher's top-K (T_t), S_t & T_t, S_t | T_t or S_t ^ T_t, and
w_t(v) the student probability p_t(v), the teacher probability q_t(v) or 1, normalized over C_t. When C_t
is the whole vocabulary and w = p this is the exact reverse KL(p_t || q_t); otherwise the mass outside
C_t is ignored: a selected-support approximation, not the full-vocabulary KL. An empty C_t (an empty
intersection, or a symmetric difference of equal top-K sets) gives d_t = 0 and is counted.

What each set needs from the two servers (`needs`): every v in C_t must have both logprobs. A model's
own top-K comes with its logprobs; the other model's top-K IDs must be asked of it by ID
(SGLang's token_ids_logprob). So the student's top-K needs a teacher pass over the student's IDs,
the teacher's top-K a student pass over the teacher's IDs; the intersection needs neither.

Who calls it: lockstep.rollout.opd.scorer; runtime/tests/rollout/test_opd_candidates.py checks it
against the closed form on fixtures with known distributions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

SETS: Final = ("student-top-k", "teacher-top-k", "intersection", "union", "symmetric-difference")
"""The candidate sets (spec.algorithm.opd.candidates.set, other than `sampled`)."""
WEIGHTS: Final = ("student", "teacher", "uniform")
"""The weightings (spec.algorithm.opd.candidates.weight)."""


@dataclass(frozen=True, slots=True)
class Needs:
    """Which scoring passes a candidate set needs."""

    student_top: bool
    """The student's top-K (S_t) takes part."""
    teacher_top: bool
    """The teacher's top-K (T_t) takes part."""
    teacher_at_student_ids: bool
    """The teacher must score the student's top-K IDs by ID."""
    student_at_teacher_ids: bool
    """The student must score the teacher's top-K IDs by ID."""


def needs(kind: str) -> Needs:
    """The passes `kind` needs (pure)."""
    if kind not in SETS:
        raise ValueError(f"unknown candidate set {kind!r}; use one of {', '.join(SETS)}")
    s = kind in ("student-top-k", "union", "symmetric-difference", "intersection")
    t = kind in ("teacher-top-k", "union", "symmetric-difference", "intersection")
    cross = kind in ("union", "symmetric-difference")
    return Needs(
        student_top=s,
        teacher_top=t,
        teacher_at_student_ids=kind == "student-top-k" or cross,
        student_at_teacher_ids=kind == "teacher-top-k" or cross,
    )


def candidate_set(kind: str, student_top: Sequence[int], teacher_top: Sequence[int]) -> list[int]:
    """C_t from the two top-K ID lists, in a fixed order (student's first, then teacher's) (pure)."""
    s, t = list(dict.fromkeys(student_top)), list(dict.fromkeys(teacher_top))
    if kind == "student-top-k":
        return s
    if kind == "teacher-top-k":
        return t
    tset, sset = set(t), set(s)
    if kind == "intersection":
        return [v for v in s if v in tset]
    if kind == "union":
        return s + [v for v in t if v not in sset]
    if kind == "symmetric-difference":
        return [v for v in s if v not in tset] + [v for v in t if v not in sset]
    raise ValueError(f"unknown candidate set {kind!r}; use one of {', '.join(SETS)}")


def logratio(
    candidates: Sequence[int], student: Mapping[int, float], teacher: Mapping[int, float], weight: str
) -> float:
    """d_t over C_t = `candidates` with the weighting `weight`, from each model's logprobs by ID (pure).

    Raises KeyError naming the ID when a candidate lacks a model's logprob (a scoring pass missed it).
    """
    if not candidates:
        return 0.0
    if weight == "uniform":
        raw = [1.0] * len(candidates)
    elif weight in ("student", "teacher"):
        side = student if weight == "student" else teacher
        top = max(side[v] for v in candidates)
        raw = [math.exp(side[v] - top) for v in candidates]  # shifted: normalized below, no underflow to 0
    else:
        raise ValueError(f"unknown weighting {weight!r}; use one of {', '.join(WEIGHTS)}")
    total = sum(raw)
    return sum(w / total * (student[v] - teacher[v]) for w, v in zip(raw, candidates, strict=True))
