"""`python -m e2e.controlplane start|stop|status`: the local control plane for people (start.sh, stop.sh).

Why: to poke at the operator by hand — `kubectl get nodes`, apply an RLJob, watch pods — against the
same control plane the tests use. `start` leaves the components running after it exits (each leads its
own process group) and records them in a state file; `stop` finds them there, stops them and checks
nothing is left. Run from the repository root.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from e2e.controlplane.cluster import DEFAULT_NODES, ControlPlane, ControlPlaneError, find_binaries

DEFAULT_STATE = (
    Path(os.environ.get("LOCKSTEP_CACHE", Path.home() / ".cache" / "lockstep"))
    / "controlplane"
    / "running.json"
)


def _start(args: argparse.Namespace) -> int:
    state = Path(args.state)
    if state.exists():
        print(f"already running (state {state}); run stop first", file=sys.stderr)
        return 1
    nodes = None if args.no_nodes else Path(args.nodes)
    cp = ControlPlane(
        bin_dir=find_binaries(),
        nodes_file=nodes,
        die_with_parent=False,
        real_node=args.real_node,
        sandboxes=args.sandboxes,
    )
    cp.start()
    cp.save_state(state)
    print(
        f"# control plane up: {cp.api_url}; logs in {cp.log_dir}; stop with e2e/controlplane/stop.sh",
        file=sys.stderr,
    )
    print(f"export KUBECONFIG={cp.kubeconfig}")
    print(f"export PATH={cp.bin_dir}:$PATH")
    if cp.node is not None:
        # The images built here for the real node (pods use them with imagePullPolicy: Never).
        print(f"export LOCKSTEP_BUSYBOX_IMAGE={cp.node.images['busybox']}")
        if args.runtime_image:
            # The operator's runtime and engine image for the examples (built and imported when its
            # inputs changed: cold about 5 GiB, node/runtime_image.py).
            print(f"export LOCKSTEP_RUNTIME_IMAGE={cp.node.runtime_image()}")
        if args.operator_image:
            # The operator's own image (images/operator.Dockerfile's recipe), for running it in-cluster;
            # also tagged ghcr.io/lockstep/lockstep-operator:<version> in the node's containerd.
            print(f"export LOCKSTEP_OPERATOR_IMAGE={cp.node.operator_image()}")
    return 0


def _stop(args: argparse.Namespace) -> int:
    state = Path(args.state)
    if not state.exists():
        print(f"nothing to stop (no {state})", file=sys.stderr)
        return 0
    cp = ControlPlane.from_state(state)
    try:
        cp.stop()
    except ControlPlaneError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    finally:
        state.unlink(missing_ok=True)
    print("stopped; no process and no port left", file=sys.stderr)
    return 0


def _status(args: argparse.Namespace) -> int:
    state = Path(args.state)
    if not state.exists():
        print("not running")
        return 1
    cp = ControlPlane.from_state(state)
    try:
        print(f"{cp.api_url} readyz: {cp.api_get('/readyz')}; KUBECONFIG={cp.kubeconfig}")
    except OSError as exc:
        print(f"state {state} exists but the apiserver does not answer: {exc}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.controlplane", description=__doc__)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state", default=str(DEFAULT_STATE), help="where start records pids/ports for stop")
    sub = parser.add_subparsers(dest="cmd", required=True)
    start = sub.add_parser("start", parents=[common], help="start and print `export KUBECONFIG=...`")
    start.add_argument("--nodes", default=str(DEFAULT_NODES), help="node pools YAML (default e2e/nodes.yaml)")
    start.add_argument("--no-nodes", action="store_true", help="start without simulated nodes")
    start.add_argument(
        "--real-node",
        action="store_true",
        help="also run a real worker node (kubelet, containerd; needs root)",
    )
    start.add_argument(
        "--sandboxes",
        action="store_true",
        help="also install kubernetes-sigs/agent-sandbox (CRDs and controller) for spec.agent.sandbox jobs",
    )
    start.add_argument(
        "--runtime-image",
        action="store_true",
        help="with --real-node: build (when changed) and import the runtime image, print LOCKSTEP_RUNTIME_IMAGE",
    )
    start.add_argument(
        "--operator-image",
        action="store_true",
        help="with --real-node: build (when changed) and import the operator image, print LOCKSTEP_OPERATOR_IMAGE",
    )
    start.set_defaults(func=_start)
    sub.add_parser("stop", parents=[common], help="stop what start started").set_defaults(func=_stop)
    sub.add_parser("status", parents=[common], help="is it running?").set_defaults(func=_status)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
