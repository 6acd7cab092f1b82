"""The engine's side of the size preamble of a weight update over a group.

Why it exists: /update_weights_from_distributed announces names, dtypes and shapes over HTTP, and the
data then arrives as collectives posted with those sizes. gloo aborts the receiving process when a
collective carries more bytes than were posted (and accepts fewer in silence), so a sender whose
collectives differ from its announcement (a bug, a stale request, a hostile rank 0) used to kill the
engine. When the whole group agreed on it at join (lockstep.serving.weight_group), the sender first
broadcasts a fixed-size preamble (tensor count, total bytes, a digest of every name, dtype and shape,
computed from what it sends); the engine compares it with the announcement before posting any data
collective. A mismatch is refused: the weights are untouched and the group is closed (the sender's
data collectives are now out of step with it), so the next update needs a new
/init_weights_update_group, which the trainer's transport does by itself.

Who calls it: lockstep.engine.server (`_receive`, on the engine's worker thread, under the step lock).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from lockstep.serving.weight_group import WeightUpdateGroup, describe_preamble, size_preamble

if TYPE_CHECKING:
    from lockstep.engine.core import ReferenceEngine

log = logging.getLogger(__name__)


class SizeMismatch(ValueError):
    """The sender's preamble does not match the announced update; nothing was received."""


def check_size_preamble(
    engine: ReferenceEngine, group: WeightUpdateGroup, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]
) -> None:
    """Receive the preamble and compare it with `specs` (name, dtype, shape as announced); raises
    SizeMismatch naming both, after closing the group, when they differ."""
    names = [n for n, _, _ in specs]
    dtypes = [str(dt).removeprefix("torch.") for _, dt, _ in specs]
    shapes = [list(shape) for _, _, shape in specs]
    want = size_preamble(names, dtypes, shapes)
    got = torch.zeros(4, dtype=torch.int64, device=engine.device)
    group.broadcast(got, src=0)
    sent = [int(v) for v in got.tolist()]
    if sent == want:
        return
    if engine.weight_group is group:
        engine.weight_group = None
    group.close()
    log.error("weight update refused: the sender's collectives carry %s", describe_preamble(sent))
    raise SizeMismatch(
        f"the sender's collectives carry {describe_preamble(sent)}, the request announces "
        f"{describe_preamble(want)}; nothing was received, and group {group.name!r} is closed "
        "(its collectives are out of step): call /init_weights_update_group again"
    )
