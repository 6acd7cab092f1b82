#!/usr/bin/env bash
# Starts the local control plane (builds missing binaries first) and prints the lines to paste:
#   eval "$(bash e2e/controlplane/start.sh)"
# Stop it with: bash e2e/controlplane/stop.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
exec "${PYTHON:-$root/.venv/bin/python}" -m e2e.controlplane start "$@"
