"""disk-delta per host: bytes the trainer writes per step against one full copy per engine.

Why: before disk-delta per host, the trainer patched one full copy per engine on the shared volume
(engines x checkpoint bytes per step); now it publishes each version once (the base at version 0,
then only deltas) and each engine's agent patches its own node-local copy (lockstep.weights.
disk_delta_shared, delta_agent). Two real reference engines (127.0.0.1 and 127.0.0.2 behind one port,
as two engine pods) with their agents' real HTTP apps, SharedDiskDelta over a shared root, the same
set-up as runtime/tests/weights/test_disk_delta_agents.py. A step changes a fraction of each tensor's
elements (--fractions; an RL step in bf16 moves part of the weights), and per step the trainer's
`update_weights_wire_bytes` is printed beside engines x the checkpoint's bytes (the baseline, what a
full copy per engine writes) and their ratio; every engine is checked to hold the trainer's tensors.

Run from the repository root:  PYTHONPATH=runtime:runtime/tests/weights python bench/weights_disk_delta_per_host.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime" / "tests" / "weights"))

from lockstep.models.tiny import materialize_builtin
from lockstep.serving.membership import ServiceMembers
from lockstep.weights.disk_delta_shared import SharedDiskDelta
from lockstep.weights.transport import EngineSet, update_members
from test_disk_delta_agents import Agents, _free_port
from test_membership import HOSTS, Engines, _holds


def step(named: list[tuple[str, torch.Tensor]], fraction: float, seed: int) -> list[tuple[str, torch.Tensor]]:
    """A trainer step that moves `fraction` of each tensor's elements."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in named:
        moved = torch.rand(t.shape, generator=g) < fraction
        out.append((name, t + moved.to(t.dtype) * torch.randn(t.shape, generator=g).to(t.dtype) * 0.01))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.1, 0.5])
    args = ap.parse_args()
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(materialize_builtin("tiny", Path(tmp) / "tiny"))
        full = sum(p.stat().st_size for p in tiny.glob("*.safetensors"))
        engines = Engines(tiny, _free_port())
        run_dir, local = Path(tmp) / "shared" / "lockstep" / "job", Path(tmp) / "node-local"
        agents = Agents(run_dir / "delta", engines, local, _free_port())
        members = ServiceMembers("pool-engines", engines.port, resolve=lambda host, port: list(HOSTS))
        urls = [engines.url(h) for h in HOSTS]
        transport = SharedDiskDelta(run_dir, tiny, urls, agent_port=agents.port, connect_wait_s=5)
        engine_set = EngineSet(members, urls)
        baseline = full * len(HOSTS)
        print(
            f"# {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}, builtin:tiny ({full} bytes), {len(HOSTS)} engines"
        )
        print(
            f"{'version':>7} {'moved':>6} {'trainer wrote':>14} {'full copy x engines':>20} {'ratio':>7} {'density':>8}"
        )
        try:
            named = sorted(load_file(str(tiny / "model.safetensors")).items())
            versions = [(0, 0.0)] + [(i + 1, f) for i, f in enumerate(args.fractions)]
            for version, fraction in versions:
                if version:
                    named = step(named, fraction, version)
                report = update_members(transport, engine_set, named, version)
                assert all(engines.version(h) == version and _holds(engines, h, named) for h in HOSTS)
                wire = report.wire_bytes
                print(
                    f"{version:>7} {fraction:>6.0%} {wire:>14} {baseline:>20} {wire / baseline:>7.3f} "
                    f"{report.extra.get('update_weights_density', 1.0):>8.3f}"
                )
        finally:
            transport.close()
            agents.close()
            engines.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
