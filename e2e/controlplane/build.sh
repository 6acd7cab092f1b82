#!/usr/bin/env bash
# Builds the e2e control plane (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl,
# etcd, kwok, the agent-sandbox controller, helm) from the pinned Go modules in kube/, kwok/,
# agent-sandbox/ and helm/, into a cache keyed by version:
#   ${LOCKSTEP_CACHE:-~/.cache/lockstep}/controlplane/k8s-<v>_etcd-<v>_kwok-<v>/bin
# Rebuilds only binaries that are missing. Prints the bin directory on its last line.
# Called by e2e/controlplane/cluster.py (and so by the test command) and usable by hand.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# GOTOOLCHAIN=local: never download a toolchain unless asked (GOTOOLCHAIN=auto fetches the one go.mod
# names through the Go module proxy when the local Go is older).
export GOTOOLCHAIN=${GOTOOLCHAIN:-local} CGO_ENABLED=0 GOFLAGS=-mod=readonly

k8s_version=$(awk '$1=="k8s.io/kubernetes"{print $2}' "$here/kube/go.mod")
etcd_version=$(awk '$1=="go.etcd.io/etcd/server/v3"{print $2}' "$here/kube/go.mod")
kwok_version=$(grep -Eo "sigs.k8s.io/kwok v[^ ]+" "$here/kwok/go.mod" | head -n1 | cut -d" " -f2)
key="k8s-${k8s_version}_etcd-${etcd_version}_kwok-${kwok_version}"
bin="${LOCKSTEP_CACHE:-$HOME/.cache/lockstep}/controlplane/$key/bin"
mkdir -p "$bin"
# Several test sessions may call this at once on a fresh machine: one builds, the others wait for it
# and then find the binaries there.
exec 9>"$bin/.build.lock"
flock 9

major=${k8s_version#v}; major=${major%%.*}
minor=${k8s_version#v*.}; minor=${minor%%.*}
ldflags="-s -w \
 -X k8s.io/component-base/version.gitVersion=${k8s_version} \
 -X k8s.io/component-base/version.gitMajor=${major} \
 -X k8s.io/component-base/version.gitMinor=${minor} \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/client-go/pkg/version.gitVersion=${k8s_version} \
 -X k8s.io/client-go/pkg/version.gitMajor=${major} \
 -X k8s.io/client-go/pkg/version.gitMinor=${minor}"

need_go() {  # a clear message instead of "go: command not found" / "go.mod requires go >= ..."
  local want
  want=$(awk '$1=="go"{print $2}' "$here/kube/go.mod")
  if ! command -v go >/dev/null; then
    echo "build.sh: the Go toolchain (>= $want) is needed to build the control plane once; install it" \
      "(https://go.dev/dl) or set LOCKSTEP_CONTROLPLANE_BIN to prebuilt binaries" >&2
    exit 2
  fi
}

build() {  # build <module dir> <package> <output name> [ldflags]
  local dir=$1 pkg=$2 out=$3 flags=${4:-"-s -w"}
  if [ -x "$bin/$out" ]; then return 0; fi
  need_go
  echo "building $out from $pkg" >&2
  local start=$SECONDS
  (cd "$here/$dir" && go build -trimpath -ldflags "$flags" -o "$bin/$out.tmp.$$" "$pkg")
  mv "$bin/$out.tmp.$$" "$bin/$out"
  echo "built $out in $((SECONDS - start)) s" >&2
}

build kube go.etcd.io/etcd/server/v3 etcd
build kube k8s.io/kubernetes/cmd/kube-apiserver kube-apiserver "$ldflags"
build kube k8s.io/kubernetes/cmd/kube-controller-manager kube-controller-manager "$ldflags"
build kube k8s.io/kubernetes/cmd/kube-scheduler kube-scheduler "$ldflags"
build kube k8s.io/kubernetes/cmd/kubectl kubectl "$ldflags"
build kwok sigs.k8s.io/kwok/cmd/kwok kwok
# The agent-sandbox controller (Sandbox, SandboxTemplate, SandboxWarmPool, SandboxClaim) by version, so a
# new pin builds next to the old one in the same cache key; the plain name links to the pinned one.
agent_sandbox_version=$(grep -Eo "sigs.k8s.io/agent-sandbox v[^ ]+" "$here/agent-sandbox/go.mod" | head -n1 | cut -d" " -f2)
build agent-sandbox sigs.k8s.io/agent-sandbox/cmd/agent-sandbox-controller \
  "agent-sandbox-controller-$agent_sandbox_version" \
  "-s -w -X sigs.k8s.io/agent-sandbox/internal/version.gitVersion=$agent_sandbox_version"
ln -sf "agent-sandbox-controller-$agent_sandbox_version" "$bin/agent-sandbox-controller"
crds="$bin/agent-sandbox-crds-$agent_sandbox_version"  # its CRDs, from the same pinned module
if [ ! -d "$crds" ]; then
  need_go
  moddir=$(cd "$here/agent-sandbox" && go mod download -json sigs.k8s.io/agent-sandbox | awk -F'"' '$2=="Dir"{print $4}')
  mkdir -p "$crds.tmp.$$" && cp "$moddir"/k8s/crds/*.yaml "$crds.tmp.$$/" && mv "$crds.tmp.$$" "$crds"
fi
ln -sfn "agent-sandbox-crds-$agent_sandbox_version" "$bin/agent-sandbox-crds"
# Helm (the chart in charts/lockstep is linted, templated and installed with it), by version like the
# agent-sandbox controller.
helm_version=$(grep -Eo "helm.sh/helm/v4 v[^ ]+" "$here/helm/go.mod" | head -n1 | cut -d" " -f2)
build helm helm.sh/helm/v4/cmd/helm "helm-$helm_version" \
  "-s -w -X helm.sh/helm/v4/internal/version.version=$helm_version -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
ln -sf "helm-$helm_version" "$bin/helm"
echo "$bin"
