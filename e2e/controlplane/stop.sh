#!/usr/bin/env bash
# Stops the control plane started by start.sh and checks no process and no port is left.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
exec "${PYTHON:-$root/.venv/bin/python}" -m e2e.controlplane stop "$@"
