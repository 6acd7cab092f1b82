"""`lockstep metrics-relay --source URL --host H --port P`: serve another endpoint's /metrics here.

Why it exists: an SGLang engine pod's `sglang:*` series are served at GET /metrics of the engine's HTTP
port, which the engine NetworkPolicy admits only from the job's own pods; this sidecar relays them on
the pod's `metrics` port, the one Prometheus may reach (lockstep.observability.metrics_relay,
docs/monitoring.md). Read-only: only GET /metrics.

Who calls it: the SGLang engine pods the operator renders (lockstep_operator.resources.metrics_relay).
"""

from __future__ import annotations

import argparse
from typing import Any

from lockstep.cli.commands import HELP
from lockstep.observability.metrics_relay import MAX_BYTES, TIMEOUT_S, relay_app


def register(sub: Any) -> None:
    p = sub.add_parser("metrics-relay", help=HELP["metrics-relay"], description=__doc__.split("\n\n")[1])
    p.add_argument("--source", required=True, metavar="URL", help="the /metrics URL to relay")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (a pod: its IP)")
    p.add_argument("--port", type=int, required=True, help="port to serve GET /metrics on")
    p.add_argument(
        "--timeout", type=float, default=TIMEOUT_S, help="seconds one fetch of the source may take"
    )
    p.add_argument("--max-bytes", type=int, default=MAX_BYTES, help="largest body relayed (larger: 502)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from aiohttp import web

    app = relay_app(args.source, timeout_s=args.timeout, max_bytes=args.max_bytes)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    return 0
