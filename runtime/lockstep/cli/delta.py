"""`lockstep delta publish|apply|verify|agent`: the disk-delta transport by hand, and its engine-side agent.

Why it exists: the disk-delta transport (lockstep.weights.disk_delta, §7.2.4) normally runs inside
the driver and the engine pods; these commands run the same code on checkpoint directories so an
operator can publish a version from two checkpoints, patch a host's local copy, or audit a publish
root. Every failure exits non-zero with a one-line reason and leaves the local checkpoint as it was.
`agent` serves lockstep.weights.delta_agent: the sidecar of every engine pod of a cluster disk-delta job.

Who calls it: people, and runtime/tests/weights/test_delta_cli.py.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from lockstep.cli.commands import HELP
from lockstep.observability.logs import configure_logging
from lockstep.serving.client import api_key_from_env
from lockstep.serving.membership import DELTA_AGENT_PORT, ENGINE_PORT, engine_url
from lockstep.weights import disk_delta as dd
from lockstep.weights.delta_agent import DeltaAgent, serve


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("delta", help=HELP["delta"])
    sub = p.add_subparsers(dest="delta_command", metavar="ACTION", required=True)

    pub = sub.add_parser("publish", help="publish NEW as the next version after BASE under ROOT")
    pub.add_argument("--base", type=Path, required=True, help="checkpoint dir of the previous version")
    pub.add_argument("--new", type=Path, required=True, help="checkpoint dir of the new version")
    pub.add_argument("--root", type=Path, required=True, help="shared publish root (weight_vNNNNNN/ dirs)")
    pub.add_argument("--encoding", choices=["xor", "overwrite"], default="xor")
    pub.add_argument("--level", type=int, default=1, help="zstd level (default 1, the spec's)")
    pub.add_argument(
        "--checksum",
        choices=["xxh3-128", "blake3", "adler32"],
        default="xxh3-128",
        help="checksum of every tensor before and after (subscribers follow the index)",
    )
    pub.add_argument("--version", type=int, default=None, help="version to publish (default: latest + 1)")
    pub.set_defaults(func=_publish)

    app = sub.add_parser("apply", help="patch a local checkpoint up to a published version")
    app.add_argument("--root", type=Path, required=True)
    app.add_argument("--local", type=Path, required=True, help="local full checkpoint dir to patch")
    app.add_argument("--version", type=int, default=None, help="target version (default: latest)")
    app.set_defaults(func=_apply)

    agent = sub.add_parser(
        "agent", help="serve the agent that keeps an engine's local copy at the published versions"
    )
    agent.add_argument("--root", type=Path, required=True, help="the shared publish root the trainer writes")
    agent.add_argument("--local", type=Path, required=True, help="this engine's node-local checkpoint copy")
    agent.add_argument(
        "--engine",
        default=None,
        help=f"the engine to reload (default: port {ENGINE_PORT} on --host, an IPv6 address in brackets)",
    )
    agent.add_argument(
        "--name", default=None, help="the agent's name in ROOT/agents/ (default: $POD_NAME or host)"
    )
    agent.add_argument("--host", default="127.0.0.1")
    agent.add_argument("--port", type=int, default=DELTA_AGENT_PORT)
    agent.add_argument("--pause-mode", choices=["retract", "abort", "in_place"], default="retract")
    agent.set_defaults(func=_agent)

    ver = sub.add_parser("verify", help="check lineage and every shard of a publish root")
    ver.add_argument("--root", type=Path, required=True)
    ver.set_defaults(func=_verify)


def agent_engine(args: argparse.Namespace) -> str:
    """The engine the agent reloads: --engine, else the engine's port on --host (the pod IP in a pod,
    where the engine listens; an IPv6 address in brackets)."""
    return str(args.engine or engine_url(args.host, ENGINE_PORT))


def _agent(args: argparse.Namespace) -> int:
    configure_logging()
    name = args.name or os.environ.get("POD_NAME") or socket.gethostname()
    agent = DeltaAgent(args.root, args.local, agent_engine(args), name=name, pause_mode=args.pause_mode)
    serve(agent, args.host, args.port, api_key_from_env())
    return 0


def _fail(msg: str) -> int:
    print(f"lockstep delta: error: {msg}", file=sys.stderr)
    return 1


def _publish(args: argparse.Namespace) -> int:
    from safetensors.torch import load_file  # torch: only when a version is published

    try:
        versions = dd.published_versions(args.root)
        base_version = versions[-1] if versions else 0
        version = args.version if args.version is not None else base_version + 1
        pub = dd.DeltaPublisher(
            args.root,
            args.base,
            encoding=args.encoding,
            level=args.level,
            base_version=base_version,
            checksum=args.checksum,
        )
        pub.check_base()
        if not (args.root / dd.BASELINE_NAME).exists():
            pub.start()
        named = {}
        for f in sorted(Path(args.new).glob("*.safetensors")):
            named.update(load_file(f))
        pub.check_export(named.items())
        result = pub.publish(sorted(named.items()), version)
    except (dd.DeltaError, OSError, ValueError) as e:
        return _fail(str(e))
    print(
        f"published version {version} (base {base_version}): {result.changed_tensors}/{result.tensors} tensors changed, "
        f"update_weights_density={result.density:.6f} update_weights_wire_bytes={result.wire_bytes}"
    )
    return 0


def _apply(args: argparse.Namespace) -> int:
    try:
        if not (args.local / dd.LOCAL_STATE_NAME).exists():
            dd.init_local(args.local, args.root, 0)
        result = dd.apply_delta(args.root, args.local, args.version)
    except (dd.DeltaError, OSError, ValueError) as e:
        return _fail(f"{e} ({args.local} left as it was)")
    print(
        f"{args.local}: version {result.from_version} -> {result.to_version}, {result.patched_tensors} tensors patched"
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    if not args.root.is_dir():
        return _fail(f"{args.root} is not a directory")
    problems = dd.verify_root(args.root)
    versions = dd.published_versions(args.root)
    for p in problems:
        print(f"problem: {p}", file=sys.stderr)
    if problems:
        return _fail(f"{len(problems)} problems under {args.root}")
    print(
        f"{args.root}: {len(versions)} complete versions {versions[:1]}..{versions[-1:]}, lineage and shards sound"
    )
    return 0
