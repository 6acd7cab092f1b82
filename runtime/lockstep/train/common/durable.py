"""Durable files for checkpoints: temp name, fsync, rename, fsync the directory.

Why it exists: a checkpoint must survive a crash or a power loss at any instant; a resume must
then find either the old complete checkpoint or the new complete one, never a torn file. POSIX gives
that only through a write to a temporary name, fsync of the file, an atomic rename, and fsync of
the directory that holds the name (without the last step the rename itself may be lost). Every
checkpoint file and the `latest` pointer go through `atomic_path`.

Who calls it: lockstep.train.fsdp.checkpoint, lockstep.train.megatron.checkpoint,
lockstep.trainer.state.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from lockstep.models.st_bytes import fsync_dir, fsync_file  # the fsync primitives, defined once


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """`with atomic_path(p) as tmp:` write the file at `tmp`; on success it is fsynced, renamed to
    `p` and the directory fsynced, so `p` is either its old content or the whole new one. On an
    exception the temporary file is removed and `p` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` durably and atomically (see atomic_path)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def join_checkpoint_dir(directory: Path, rank: int) -> None:
    """The start of a collective checkpoint write: rank 0 creates `directory`, then every rank waits
    for it (a barrier) before it writes a file there.

    Why: whoever saves into a temporary directory (lockstep.trainer.state.save_checkpoint) removes a
    stale one on rank 0 first; without the barrier, a rank that is ahead writes its files before that
    removal and loses them. Ranks > 0 create the directory too (exist_ok) in case their run dir is
    not shared with rank 0 (an emptyDir per node); they never remove anything.
    """
    import torch.distributed as dist

    if rank == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    Path(directory).mkdir(parents=True, exist_ok=True)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, deepest first, then `root` itself."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))
