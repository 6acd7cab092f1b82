"""The candidate-set estimate of OPD's log-ratio against its closed form on known distributions.

Fixture: a vocabulary of 8 tokens with a student p and a teacher q written out, K = 3. The student's
top-3 is {0, 1, 2}, the teacher's {2, 3, 0}: intersection {0, 2}, union {0, 1, 2, 3}, symmetric
difference {1, 3}. The expected values are computed here by hand from the definition
sum_{v in C} w(v) (log p(v) - log q(v)), w normalized over C, independently of the module's code.
"""

from __future__ import annotations

import math

import pytest
from lockstep.rollout.opd.candidates import SETS, candidate_set, logratio, needs

P = [0.40, 0.25, 0.15, 0.08, 0.05, 0.04, 0.02, 0.01]
Q = [0.20, 0.05, 0.35, 0.30, 0.04, 0.03, 0.02, 0.01]
LP = {v: math.log(p) for v, p in enumerate(P)}
LQ = {v: math.log(q) for v, q in enumerate(Q)}


def _top(dist: list[float], k: int) -> list[int]:
    return sorted(range(len(dist)), key=lambda v: -dist[v])[:k]


def _closed_form(cands: list[int], weight: str) -> float:
    if weight == "student":
        z = sum(P[v] for v in cands)
        w = {v: P[v] / z for v in cands}
    elif weight == "teacher":
        z = sum(Q[v] for v in cands)
        w = {v: Q[v] / z for v in cands}
    else:
        w = {v: 1 / len(cands) for v in cands}
    return sum(w[v] * (math.log(P[v]) - math.log(Q[v])) for v in cands)


EXPECTED_SETS = {
    "student-top-k": [0, 1, 2],
    "teacher-top-k": [2, 3, 0],
    "intersection": [0, 2],
    "union": [0, 1, 2, 3],
    "symmetric-difference": [1, 3],
}


@pytest.mark.parametrize("kind", SETS)
@pytest.mark.parametrize("weight", ["student", "teacher", "uniform"])
def test_each_set_and_weighting_matches_the_closed_form(kind: str, weight: str) -> None:
    s_top, t_top = _top(P, 3), _top(Q, 3)
    cands = candidate_set(kind, s_top, t_top)
    assert sorted(cands) == sorted(EXPECTED_SETS[kind])
    assert logratio(cands, LP, LQ, weight) == pytest.approx(
        _closed_form(EXPECTED_SETS[kind], weight), abs=1e-12
    )


def test_the_whole_vocabulary_weighted_by_the_student_is_the_exact_reverse_kl() -> None:
    kl = sum(p * math.log(p / q) for p, q in zip(P, Q, strict=True))
    assert logratio(list(range(8)), LP, LQ, "student") == pytest.approx(kl, abs=1e-12)
    assert kl > 0


def test_the_selected_support_is_an_approximation_not_the_kl() -> None:
    kl = sum(p * math.log(p / q) for p, q in zip(P, Q, strict=True))
    top3 = logratio(candidate_set("student-top-k", _top(P, 3), _top(Q, 3)), LP, LQ, "student")
    assert abs(top3 - kl) > 0.01  # the mass outside C_t is ignored


def test_an_empty_set_gives_zero_and_a_missing_logprob_is_named() -> None:
    assert logratio([], LP, LQ, "student") == 0.0
    assert candidate_set("symmetric-difference", [1, 2], [2, 1]) == []
    with pytest.raises(KeyError, match="5"):
        logratio([0, 5], LP, {0: 0.0}, "uniform")


def test_what_each_set_asks_of_the_servers() -> None:
    assert needs("teacher-top-k").student_at_teacher_ids and not needs("teacher-top-k").teacher_at_student_ids
    assert needs("student-top-k").teacher_at_student_ids and not needs("student-top-k").student_at_teacher_ids
    both = needs("union")
    assert both.teacher_at_student_ids and both.student_at_teacher_ids
    inter = needs("intersection")  # each model's own top-K carries its logprobs: no pass by ID
    assert not inter.teacher_at_student_ids and not inter.student_at_teacher_ids
