"""The check at start that a teacher and the student map every token ID to the same string.

Why it exists: a teacher scores the student's token IDs (§8.1), so the two models must read every
ID as the same text; a teacher with another tokenizer would score a different sentence without any
error. Before the first step both servers decode every ID of the student's vocabulary one by one through
SGLang's /v1/detokenize (special tokens kept), in chunks, and the first ID whose strings differ fails the
run, naming the teacher, the ID and both strings. A teacher whose vocabulary is smaller refuses IDs it
does not have: that fails naming the range.

Who calls it: lockstep.driver (once per teacher, before step 1).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from lockstep.rollout.fatal import StopsTheRun
from lockstep.serving.client import EngineError

Detokenize = Callable[[Sequence[Sequence[int]]], Awaitable[list[str]]]
"""EngineClient.detokenize: ID lists -> one string each."""

CHUNK = 4096
"""IDs per /v1/detokenize request."""


class TokenizerMismatch(StopsTheRun, ValueError):
    """A teacher's tokenizer maps some token ID to another string than the student's."""


class TeacherRefused(StopsTheRun, PermissionError):
    """A teacher answered 401/403: the driver does not hold the key its engines take."""


async def check_same_tokenizer(
    teacher: str,
    teacher_decode: Detokenize,
    student_decode: Detokenize,
    vocab_size: int,
    *,
    chunk: int = CHUNK,
) -> int:
    """Compare IDs 0..vocab_size-1 on both servers; returns how many were compared.

    Raises TokenizerMismatch at the first differing ID (or a range the teacher refuses)."""
    for lo in range(0, vocab_size, chunk):
        ids = [[i] for i in range(lo, min(lo + chunk, vocab_size))]
        mine = await student_decode(ids)
        try:
            theirs = await teacher_decode(ids)
        except EngineError as e:
            if e.status in (401, 403):  # the teacher refuses the caller, not the IDs
                raise TeacherRefused(
                    f"spec.algorithm.opd.teachers[{teacher}]: the teacher refused the driver ({e.message}): "
                    "a url teacher takes the job's key (LOCKSTEP_API_KEY), a poolRef teacher its pool's "
                    f"(LOCKSTEP_TEACHER_API_KEY_<NAME>, set by the operator): serve the teacher with that key"
                ) from e
            raise TokenizerMismatch(
                f"spec.algorithm.opd.teachers[{teacher}]: the teacher cannot decode token IDs "
                f"{lo}..{lo + len(ids) - 1} of the student's vocabulary ({vocab_size} IDs): {e.message}; "
                "OPD scores the student's token IDs, so the teacher needs the student's tokenizer"
            ) from e
        for [i], a, b in zip(ids, mine, theirs, strict=True):
            if a != b:
                raise TokenizerMismatch(
                    f"spec.algorithm.opd.teachers[{teacher}]: token ID {i} is {b!r} for the teacher and "
                    f"{a!r} for the student; OPD scores the student's token IDs, so both must map every ID "
                    "to the same string: use a teacher with the student's tokenizer"
                )
    return vocab_size
