#!/usr/bin/env bash
# Builds a real Prometheus (prometheus + promtool) for the monitoring tests (e2e/test_prometheus.py,
# operator/tests/test_monitoring.py) from the pinned Go module in this directory, into a cache keyed by
# its version:
#   ${LOCKSTEP_CACHE:-~/.cache/lockstep}/prometheus/<module version>/bin/{prometheus,promtool}
# Build tags remove_all_sd,enable_kubernetes_sd keep Kubernetes pod discovery (what
# manifests/monitoring/prometheus.yaml and the PodMonitors use) and drop the cloud ones (half the build).
# Not Debian's package: bookworm's prometheus 2.42.0+ds is built without Kubernetes discovery
# (`field kubernetes_sd_configs not found`). Idempotent (a second run only checks); prints the bin
# directory last. Called by `make controlplane` (so by `make test`) and by e2e/controlplane/promserver.py
# when the cache is empty. $LOCKSTEP_PROMETHEUS_BIN (a directory holding both binaries) skips all of this.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export GOTOOLCHAIN=${GOTOOLCHAIN:-local} CGO_ENABLED=0 GOFLAGS=-mod=readonly
if [ -n "${LOCKSTEP_PROMETHEUS_BIN:-}" ]; then
  for tool in prometheus promtool; do
    [ -x "$LOCKSTEP_PROMETHEUS_BIN/$tool" ] || {
      echo "install.sh: LOCKSTEP_PROMETHEUS_BIN=$LOCKSTEP_PROMETHEUS_BIN has no executable $tool; unset it to build the pinned one" >&2
      exit 2
    }
  done
  echo "$LOCKSTEP_PROMETHEUS_BIN"
  exit 0
fi
version=$(awk '$1=="require" && $2=="github.com/prometheus/prometheus"{print $3}' "$here/go.mod")
bin="${LOCKSTEP_CACHE:-$HOME/.cache/lockstep}/prometheus/$version/bin"
mkdir -p "$bin"
exec 9>"$bin/.build.lock"  # concurrent test sessions: one builds, the others wait and find it
flock 9
for tool in prometheus promtool; do
  [ -x "$bin/$tool" ] && continue
  if ! command -v go >/dev/null; then
    echo "install.sh: the Go toolchain (>= $(awk '$1=="go"{print $2}' "$here/go.mod")) is needed to build Prometheus once;" \
      "install it (https://go.dev/dl) or set LOCKSTEP_PROMETHEUS_BIN to a directory with prometheus and promtool" >&2
    exit 2
  fi
  echo "building $tool $version" >&2
  start=$SECONDS
  (cd "$here" && go build -tags remove_all_sd,enable_kubernetes_sd -trimpath -ldflags "-s -w" \
    -o "$bin/$tool.tmp.$$" "github.com/prometheus/prometheus/cmd/$tool")
  mv "$bin/$tool.tmp.$$" "$bin/$tool"
  echo "built $tool in $((SECONDS - start)) s" >&2
done
echo "$bin"
