#!/usr/bin/env bash
# Installs the Debian packages a real node of the e2e cluster runs on: containerd, runc, the CNI
# plugins (bridge, host-local, portmap, loopback), iptables and ipset (kube-router enforces
# NetworkPolicy with them), mmdebstrap and qemu-user-static (the images, amd64 and arm64);
# busybox-static is only unpacked into the cache (the test image's userland), never installed.
# Idempotent: installs only what is missing, so a
# warm machine pays nothing. Needs root (a real node needs root anyway). Called by build.sh.
set -euo pipefail
cache=${LOCKSTEP_CACHE:-$HOME/.cache/lockstep}/node
packages=()
command -v containerd >/dev/null || packages+=(containerd)
command -v runc >/dev/null || packages+=(runc)
[ -x /usr/lib/cni/bridge ] || packages+=(containernetworking-plugins)
command -v iptables >/dev/null || packages+=(iptables)
command -v ipset >/dev/null || packages+=(ipset)  # kube-router's NetworkPolicy sets
command -v nsenter >/dev/null || packages+=(util-linux)
command -v ip >/dev/null || packages+=(iproute2)
command -v mmdebstrap >/dev/null || packages+=(mmdebstrap)  # the images' Debian rootfs
# The arm64 images' entry commands, run under user-mode emulation (e2e/test_images.py)
command -v qemu-aarch64-static >/dev/null || packages+=(qemu-user-static)
apt_get() { DEBIAN_FRONTEND=noninteractive apt-get -q -o=Dpkg::Use-Pty=0 "$@"; }
if [ ${#packages[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "deps.sh: a real node needs root to install ${packages[*]} (apt-get install)" >&2
    exit 2
  fi
  echo "deps.sh: installing ${packages[*]}" >&2
  apt_get install -y --no-install-recommends "${packages[@]}" >&2 \
    || { apt_get update >&2 && apt_get install -y --no-install-recommends "${packages[@]}" >&2; }
fi
# The test image's userland: Debian's static busybox, unpacked (not installed) once.
if [ ! -x "$cache/busybox/bin/busybox" ]; then
  tmp=$(mktemp -d) && chmod 755 "$tmp"  # apt downloads as user _apt
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && { apt_get download busybox-static >&2 || { apt_get update >&2 && apt_get download busybox-static >&2; }; })
  mkdir -p "$cache/busybox.tmp"
  dpkg-deb -x "$tmp"/busybox-static_*.deb "$cache/busybox.tmp"
  rm -rf "$cache/busybox" && mv "$cache/busybox.tmp" "$cache/busybox"
fi
