"""`lockstep unload-adapter NAME --engine URL...`: unload every version of LoRA adapter NAME from engines.

Why it exists: a job on a shared RolloutPool loads its adapter versions (`NAME-v<version>`) on the
pool's engines and unloads them when it ends (lockstep.weights.adapter.AdapterSync.close). A job whose
trainer was killed before that close (SIGKILL, OOM, a lost node, a forced delete) leaves them loaded
until the pool restarts. When such a job is deleted or ends, the operator runs this command in a pod of
the pool's clients (docs/lora.md, "Cleanup"): for each engine it lists GET /v1/models and sends stock
SGLang's POST /unload_lora_adapter {lora_name} for every loaded `NAME-v<version>` (and NAME itself).
Other adapters are never touched. The API key is LOCKSTEP_API_KEY (the pool's Secret).

Contract: exit 0 once every engine answered (printing what it unloaded, per engine); exit 2 naming
the engine and SGLang's reason otherwise (the operator runs it again).

Who calls it: the pod the operator renders for a standalone pool (lockstep_operator.resources.adapter_gc).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from lockstep.cli.commands import HELP
from lockstep.serving.client import EngineClient, EngineError
from lockstep.serving.lora import unload_versions


def register(sub: Any) -> None:
    p = sub.add_parser("unload-adapter", help=HELP["unload-adapter"], description=__doc__.split("\n\n")[1])
    p.add_argument(
        "adapter", metavar="NAME", help="the adapter name (spec.model.lora.adapterName, or the job's name)"
    )
    p.add_argument(
        "--engine", action="append", required=True, metavar="URL", help="an engine's base URL (repeatable)"
    )
    p.set_defaults(func=_run)


async def _unload(adapter: str, urls: list[str]) -> int:
    failed = 0
    for url in urls:
        async with EngineClient(url, retries=3, timeout_s=120.0) as client:
            try:
                names = await unload_versions(client, adapter)
            except (EngineError, ConnectionError) as e:  # refused, or unreachable after the retries
                print(f"error: engine {url}: {e}", file=sys.stderr)
                failed += 1
                continue
        print(f"{url}: unloaded {', '.join(names) if names else 'nothing'} of adapter {adapter}")
    return 2 if failed else 0


def _run(args: argparse.Namespace) -> int:
    return asyncio.run(_unload(args.adapter, list(args.engine)))
