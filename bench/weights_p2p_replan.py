"""P2P re-plan when an engine joins: the time the next update spends following the new membership.

Why: under autoscaling an engine that joins between updates must get a new P2P transfer plan before
the next update (lockstep.weights.p2p `follow`: fetch the joining engine's receive buffer, drop the
ones that left, plan the transfers again), and that time is on the update's critical path. Two real
reference engines on 127.0.0.1 and 127.0.0.2 (one port, as two pods behind a headless Service; the
membership is the real ServiceMembers with a resolver that lists one address, then both), the
transport the factory builds for `p2p` (P2P over Mooncake's TransferEngine, TCP here, with its
broadcast fallback). Measured in the same run, --runs times each:

- steady: an update to one engine whose membership did not change (its `membership` phase and total);
- join: the update right after the second engine was listed (its `membership` phase: the re-plan);
- the re-plan's share of that update, and the join's membership phase / the steady update's total.

Run from the repository root:  PYTHONPATH=runtime:runtime/tests/weights python bench/weights_p2p_replan.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime" / "tests" / "weights"))

from lockstep.models.tiny import materialize_builtin
from lockstep.serving.membership import ServiceMembers
from test_membership import Engines, Pushes, _export, _free_port, _weights


def one_round(tiny: Path, tmp: Path, version: int) -> dict[str, Any]:
    engines = Engines(tiny, _free_port())
    listed = ["127.0.0.1"]
    members = ServiceMembers("pool-engines", engines.port, resolve=lambda host, port: list(listed))
    pushes = Pushes("p2p", members, [engines.url("127.0.0.1")], tiny, tmp)
    try:
        pushes.update_weights(_export(_weights(tiny, version)), version)  # the first plan
        steady = pushes.update_weights(_export(_weights(tiny, version + 1)), version + 1)
        listed.append("127.0.0.2")
        join = pushes.update_weights(_export(_weights(tiny, version + 2)), version + 2)
        assert join.extra["update_weights_engines"] == 2.0 and join.transport == "p2p", join
        assert engines.version("127.0.0.2") == version + 2
    finally:
        pushes.close()
        engines.close()
    return {
        "steady_update_s": steady.seconds,
        "steady_membership_s": steady.phases.get("membership", 0.0),
        "join_update_s": join.seconds,
        "join_membership_s": join.phases.get("membership", 0.0),
        "replans": join.extra.get("update_weights_p2p_replans"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(materialize_builtin("tiny", Path(tmp) / "tiny"))
        for i in range(args.runs):
            rows.append(one_round(tiny, Path(tmp) / f"run{i}", 10 * i + 1))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "replans"}
    print(
        f"# {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}, builtin:tiny, 1 -> 2 engines, {args.runs} runs"
    )
    for r in rows:
        print(
            f"steady {r['steady_update_s'] * 1e3:7.1f} ms (membership {r['steady_membership_s'] * 1e3:5.2f} ms); "
            f"join {r['join_update_s'] * 1e3:7.1f} ms (membership {r['join_membership_s'] * 1e3:6.2f} ms)"
        )
    print(
        f"median re-plan (membership phase of the join update): {med['join_membership_s'] * 1e3:.2f} ms = "
        f"{med['join_membership_s'] / med['join_update_s']:.2f} of that update, "
        f"{med['join_membership_s'] / med['steady_update_s']:.2f}x a steady update "
        f"({med['steady_update_s'] * 1e3:.1f} ms; its membership phase {med['steady_membership_s'] * 1e3:.2f} ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
