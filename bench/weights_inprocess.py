"""One machine, no disk in the loop: the in-process handoff against from-disk, at the Qwen3-0.6B shape.

Why: `lockstep run` embeds its engines; `transport: auto` used to write a full safetensors checkpoint
per version and have every engine reload it (from-disk), where the engine can take the trainer's
tensors in memory (lockstep.weights.inprocess). Both run here into the same real reference engine
(served over HTTP on 127.0.0.1 on its own loop thread, as `lockstep run` serves it) holding the builtin
`bigger` model (Qwen3-0.6B shape, bf16, 1.19 GB of weights); the "trainer" holds the same tensors after
a fake step. Printed per transport: the median update of --runs, its phases (lockstep.weights.phases),
and the ratio from-disk / in-process measured in this run. The projection to the Qwen3-4B shape of
examples/h100.yaml (8.05 GB of bf16) scales each phase by the bytes, which holds for the
byte-proportional phases (copies, writes, reads) and overstates the fixed ones (HTTP calls).

Run from the repository root (needs ~6 GB of memory and ~3 GB of disk under --tmp):
  PYTHONPATH=runtime .venv/bin/python bench/weights_inprocess.py [--runs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

QWEN3_4B_BYTES = 4_022_468_096 * 2
"""Qwen3-4B's parameters (tied embeddings counted once) in bf16: what one update moves at that shape."""


class Engine:
    """The reference engine behind its HTTP app, on a loop thread of this process (as lockstep run does)."""

    def __init__(self, model_dir: Path) -> None:
        from aiohttp import web
        from lockstep.engine import ReferenceEngine, create_app

        self.engine = ReferenceEngine.load(model_dir, dtype=torch.bfloat16, max_running_requests=2)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(create_app(self.engine))

        async def start() -> int:
            await self.engine.start()
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

        self.url = f"http://127.0.0.1:{asyncio.run_coroutine_threadsafe(start(), self.loop).result(120)}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        asyncio.run_coroutine_threadsafe(self.engine.close(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)


def run_updates(
    transport: Any, url: str, named: list[tuple[str, torch.Tensor]], runs: int, first: int
) -> list[Any]:
    from lockstep.serving.membership import StaticMembers
    from lockstep.weights.transport import EngineSet, update_members

    engines = EngineSet(StaticMembers((url,)), [url])
    return [update_members(transport, engines, iter(named), first + i) for i in range(runs)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tmp", type=Path, default=None, help="where the checkpoint and from-disk versions go")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from lockstep.engine.handoff import EngineHandoff
    from lockstep.models.tiny import materialize_builtin
    from lockstep.weights.from_disk import MODEL_FILES, FromDiskTransport
    from lockstep.weights.inprocess import InProcessTransport
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        model_dir = materialize_builtin("bigger", Path(tmp) / "bigger")
        engine = Engine(model_dir)
        try:
            named = []
            g = torch.Generator().manual_seed(1)
            for name, t in load_file(str(model_dir / "model.safetensors")).items():
                t = t.to(torch.bfloat16)
                named.append(
                    (name, t + (torch.randn(t.shape, generator=g) * 1e-3).to(t.dtype))
                )  # a fake step
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
            inproc = InProcessTransport([EngineHandoff(engine.engine, engine.loop, engine.url)])
            disk = FromDiskTransport(Path(tmp) / "weights", [], config_dir=model_dir, extra_files=MODEL_FILES)
            reports = {
                "in-process": run_updates(inproc, engine.url, named, args.runs, 1),
                "from-disk": run_updates(disk, engine.url, named, args.runs, 1 + args.runs),
            }
            disk.close()
            held = engine.engine.named_weights()
            assert all(torch.equal(held[n], t) for n, t in named), "the engine does not hold the update"
        finally:
            engine.close()
    lines = [
        f"# {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.uname().nodename}, load {os.getloadavg()[0]:.1f}; "
        f"builtin bigger (Qwen3-0.6B shape) bf16, {len(named)} tensors, {nbytes / 1e9:.2f} GB; median of {args.runs}",
        f"{'transport':>12} {'update s':>9} {'GB/s':>6} {'at Qwen3-4B s':>14}  phases (s)",
    ]
    median: dict[str, float] = {}
    scale = QWEN3_4B_BYTES / nbytes
    for name, rs in reports.items():
        median[name] = statistics.median(r.seconds for r in rs)
        mid = sorted(rs, key=lambda r: r.seconds)[len(rs) // 2]
        parts = " ".join(
            f"{p}={s:.3f}" for p, s in sorted(mid.phases.items(), key=lambda kv: -kv[1]) if s >= 5e-4
        )
        lines.append(
            f"{name:>12} {median[name]:>9.3f} {nbytes / median[name] / 1e9:>6.2f} {median[name] * scale:>14.2f}  {parts}"
        )
    lines.append(
        f"from-disk / in-process: {median['from-disk'] / median['in-process']:.2f}x "
        f"(disk written per update: from-disk {nbytes / 1e9:.2f} GB, in-process 0)"
    )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
