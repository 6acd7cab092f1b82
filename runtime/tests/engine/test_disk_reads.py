"""The disk-update reader's bounds, on real files: a deadline, and a FIFO that appears after the check.

The end-to-end cases (a FIFO in place of the weights, paths outside the weight root, through
`lockstep engine`) are in test_engine_process_alive.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from lockstep.engine.disk_reads import DiskPolicy, DiskRefused, _read_regular, read_checkpoint


async def test_a_read_past_its_deadline_is_refused(tiny_dir: Path) -> None:
    """What a hung network volume looks like to the request: no answer within the deadline. (A read
    that cannot finish cannot be made here; a deadline shorter than any read stands in for it.)"""
    with pytest.raises(TimeoutError, match="took longer than"):
        await read_checkpoint(str(tiny_dir), DiskPolicy.of(None, deadline_s=1e-9))
    named = await read_checkpoint(str(tiny_dir), DiskPolicy.of([tiny_dir.parent]))
    assert named and all(t.numel() for _, t in named)


def test_a_fifo_swapped_in_after_the_check_never_blocks(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(DiskRefused, match="not a regular file"):
        _read_regular(fifo)  # opened non-blocking, refused on the descriptor's type


async def test_a_truncated_file_is_named(tmp_path: Path, tiny_dir: Path) -> None:
    data = (tiny_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(DiskRefused, match=r"model\.safetensors: not a readable safetensors file"):
        await read_checkpoint(str(tmp_path), DiskPolicy.of([tmp_path]))
