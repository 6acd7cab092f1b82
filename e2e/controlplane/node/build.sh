#!/usr/bin/env bash
# Builds what a real worker node of the e2e cluster runs, next to the control plane of ../build.sh:
# kubelet and kube-proxy from the same pinned Kubernetes module (../kube/go.mod), CoreDNS from
# ../coredns/go.mod, kube-router (the NetworkPolicy enforcer, firewall only) from ../kube-router/go.mod,
# and the sandbox (pause) process from ./pause; and installs the Debian packages (containerd, runc,
# CNI plugins, ipset) through deps.sh. Binaries are cached keyed by version:
#   ${LOCKSTEP_CACHE:-~/.cache/lockstep}/node/k8s-<v>_coredns-<v>/bin
# (kube-router as kube-router-<v>, pause as pause-<hash of its source>, each with a plain-name link).
# Rebuilds only what is missing. Prints the bin directory on its last line.
# Called by e2e/controlplane/realnode.py (and so by the test command) and usable by hand.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cp_dir=$(dirname "$here")
export GOTOOLCHAIN=${GOTOOLCHAIN:-local} CGO_ENABLED=0 GOFLAGS=-mod=readonly

bash "$here/deps.sh"

k8s_version=$(awk '$1=="k8s.io/kubernetes"{print $2}' "$cp_dir/kube/go.mod")
coredns_version=$(awk '$1=="require" && $2=="github.com/coredns/coredns"{print $3} $1=="github.com/coredns/coredns"{print $2}' \
  "$cp_dir/coredns/go.mod" | head -n1)
kube_router_version=$(awk '$1=="github.com/cloudnativelabs/kube-router/v2"{print $2}' "$cp_dir/kube-router/go.mod")
pause_hash=$(cat "$here/pause/go.mod" "$here/pause/main.go" | sha256sum | cut -c1-12)
bin="${LOCKSTEP_CACHE:-$HOME/.cache/lockstep}/node/k8s-${k8s_version}_coredns-${coredns_version}/bin"
mkdir -p "$bin"
exec 9>"$bin/.build.lock"  # concurrent sessions: one builds, the others wait and find the binaries
flock 9

major=${k8s_version#v}; major=${major%%.*}
minor=${k8s_version#v*.}; minor=${minor%%.*}
ldflags="-s -w \
 -X k8s.io/component-base/version.gitVersion=${k8s_version} \
 -X k8s.io/component-base/version.gitMajor=${major} \
 -X k8s.io/component-base/version.gitMinor=${minor} \
 -X k8s.io/component-base/version.gitTreeState=clean"

build() {  # build <module dir> <package> <output name> [ldflags]
  local dir=$1 pkg=$2 out=$3 flags=${4:-"-s -w"}
  if [ -x "$bin/$out" ]; then return 0; fi
  if ! command -v go >/dev/null; then
    echo "node/build.sh: the Go toolchain is needed to build $out once; install it (https://go.dev/dl)" >&2
    exit 2
  fi
  echo "building $out from $pkg" >&2
  local start=$SECONDS
  (cd "$dir" && go build -trimpath -ldflags "$flags" -o "$bin/$out.tmp.$$" "$pkg")
  mv "$bin/$out.tmp.$$" "$bin/$out"
  echo "built $out in $((SECONDS - start)) s" >&2
}

build "$here/pause" . "pause-$pause_hash"
build "$cp_dir/kube" k8s.io/kubernetes/cmd/kubelet kubelet "$ldflags"
build "$cp_dir/kube" k8s.io/kubernetes/cmd/kube-proxy kube-proxy "$ldflags"
build "$cp_dir/coredns" . coredns
build "$cp_dir/kube-router" github.com/cloudnativelabs/kube-router/v2/cmd/kube-router \
  "kube-router-$kube_router_version" \
  "-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$kube_router_version"
ln -sf "pause-$pause_hash" "$bin/pause"
ln -sf "kube-router-$kube_router_version" "$bin/kube-router"
echo "$bin"
