"""A trainer rank without the driver: join, load the checkpoint sharded, optionally SFT, save.

Why it exists: `lockstep trainer` without --serve proves a rank's path on its own (the sharded load, the
SFT warm start's rows, the save) before a job relies on it; it needs no engine and no driver. The
serving rank is lockstep.trainer.server's.

Who calls it: lockstep.cli.trainer (without --serve), tests (world size 1 and 2 with gloo).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from lockstep.models.hub_data import resolve_data
from lockstep.tasks import data_task
from lockstep.train.common.losses import sft_loss
from lockstep.train.common.packing import pack_sft
from lockstep.train.factory import build_backend
from lockstep.trainer.parts import SftRows
from lockstep.trainer.settings import TrainerConfig


def sft_and_save(config: TrainerConfig, out: Path, *, cache_dir: Path | None, steps: int | None) -> None:
    """Join, load sharded, take `steps` SFT steps (None: the warm start's), save under `out`; prints
    one summary line on rank 0."""
    s = config.settings
    model_dir = config.model.resolve(cache_dir, seed=s.seed)
    tok = config.model.load_tokenizer(model_dir, cache_dir)
    task = data_task(resolve_data(config.data))
    lr = s.sft_learning_rate or s.learning_rate
    backend = build_backend(replace(config.backend, lr=lr), model_dir)
    try:
        want = config.world_size
        if backend.world_size != want and backend.rank == 0:
            print(
                f"warning: world size {backend.world_size} != trainer.nodes x gpusPerNode = {want}",
                file=sys.stderr,
            )
        steps = steps if steps is not None else s.sft_steps
        render = lambda msgs: tok.render(msgs, add_generation_prompt=True)  # noqa: E731
        rows = SftRows(task, render, tok.encode, [tok.eos_token_id], tok.reply_pair)
        loss = float("nan")
        for k in range(steps):
            # Each rank trains on its own slice of the global batch (data parallel over FSDP shards).
            pairs = rows.step(k, s.sft_rows, rank=backend.rank, world_size=backend.world_size)
            loss = backend.train_step(pack_sft(pairs, tok.pad_token_id), sft_loss).loss
        backend.save(out, extra={"sft_steps": steps})
        if backend.rank == 0:
            print(
                f"trainer: world size {backend.world_size}, {steps} SFT steps, last loss {loss:.4f}, saved {out}"
            )
    finally:
        backend.close()
