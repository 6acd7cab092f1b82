"""tito_session_mismatch: re-render a session canonically and classify how it differs from the held row.

Why it exists (§3, built-in diagnostic): the held tokens are authoritative, but comparing them
with what the canonical chat template would produce tells a healthy session from a broken family
module. Differences are classified:

- assistant_text: the sampled assistant tokens differ from the template's tokenization of the same
  text. Expected: it is exactly what TITO preserves (the model's own IDs, not the template's).
- special_token_count / special_token_type: control tokens (role markers, stop, think, tool-call
  markers) differ in number or kind. A bug in the template or the seam merge.
- non_assistant_text: prompt, user or tool text differs. A bug: environment text is tokenized by
  us and must match the canonical render.

The canonical render never replaces the served or trained row; this is a metric only.

Who calls it: lockstep.rollout.session.server (on sample assembly, exported as a Prometheus metric).
"""

from __future__ import annotations

from collections.abc import Sequence

from lockstep.models.registry import ModelFamily

MISMATCH_TYPES = ("assistant_text", "special_token_count", "special_token_type", "non_assistant_text")
"""Every classification, for metric labels."""
BUG_TYPES = frozenset(MISMATCH_TYPES[1:])
"""The classifications that indicate a bug (everything except assistant_text)."""


def _runs(ids: Sequence[int], family: ModelFamily) -> tuple[list[int], list[tuple[str, list[int]]]]:
    """Split a row into its control tokens and the text runs between them, each with its role."""
    specials: list[int] = []
    runs: list[tuple[str, list[int]]] = []
    role = "prompt"
    cur: list[int] = []
    pending_role_line = False
    for t in ids:
        if t in family.special_ids:
            runs.append((role, cur))
            cur = []
            specials.append(t)
            opened = family.role_openers.get(t)
            if opened is not None:
                role = opened or role
                pending_role_line = opened == ""
            elif t in family.stop_ids:
                role = "seam"  # text after a turn's closing token belongs to no message (Qwen's "\n")
            continue
        cur.append(t)
        if pending_role_line and len(cur) <= 8:
            # ChatML: the role is the first line of the text after <|im_start|>.
            head = family.codec.decode(cur)
            if "\n" in head or len(cur) == 8:
                role = head.split("\n", 1)[0].strip() or role
                pending_role_line = False
    runs.append((role, cur))
    return specials, runs


def classify(expected: Sequence[int], held: Sequence[int], family: ModelFamily) -> list[str]:
    """Mismatch types between the canonical render and the held row; [] when identical."""
    if list(expected) == list(held):
        return []
    exp_specials, exp_runs = _runs(expected, family)
    held_specials, held_runs = _runs(held, family)
    if len(exp_specials) != len(held_specials):
        return ["special_token_count"]
    if exp_specials != held_specials:
        return ["special_token_type"]
    found: set[str] = set()
    for (role, a), (_, b) in zip(exp_runs, held_runs, strict=True):
        if a != b:
            found.add("assistant_text" if role == "assistant" else "non_assistant_text")
    return [t for t in MISMATCH_TYPES if t in found]


def closed_row(row: Sequence[int], family: ModelFamily) -> list[int]:
    """The held row with its last turn closed as the template closes it (the family's seam merge)."""
    m = family.merge(row[-4:], ())
    return [*row[: len(row) - m.trim], *m.bridge]
