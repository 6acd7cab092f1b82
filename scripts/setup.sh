#!/usr/bin/env bash
# Sets up ./.venv with Lockstep and everything its roles and tests need, from PyPI only, at the versions
# in constraints.txt (`make lock` refreshes them).
# Idempotent: a second run only checks. pip's cache (~/.cache/pip) stays warm between runs so a warm
# CI run does not download torch again. Called by `make run`, `make test` and .ci/run (through make).
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.lockstep-setup
# Debian libraries that Mooncake's TransferEngine wheel loads (P2P weight transfer over TCP/RDMA).
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || ! ldconfig -p 2>/dev/null | grep -q libnuma.so.1; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -q libibverbs1 libnuma1 >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 libnuma1 >/dev/null; }) \
      || echo "setup: could not install libibverbs1 libnuma1; P2P tests will be skipped" >&2
  fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip setuptools wheel
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[runtime,p2p,megatron,dev]"
  echo "$want" > "$stamp"
fi
# SGLang as the contract tests' oracle (runtime/tests/sglang): its own ServerArgs parser, routes and
# request structs, and its /metrics server (uvicorn, e2e/test_sglang_metrics_relay.py). Never imported by
# the runtime (an import-linter contract). It cannot run here, so the wheel goes in without its
# dependencies, plus the few small modules its argument parser, request structs and /metrics server
# import. The version is read from its one pin, SGLANG_VERSION in runtime/lockstep/api/profiles.py.
sglang_version=$(sed -n 's/^SGLANG_VERSION: Final = "\(.*\)"$/\1/p' runtime/lockstep/api/profiles.py)
[ -n "$sglang_version" ] || { echo "setup: no SGLANG_VERSION in runtime/lockstep/api/profiles.py" >&2; exit 2; }
if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$sglang_version')" 2>/dev/null; then
  .venv/bin/python -m pip install -q --no-deps "sglang==$sglang_version"
fi
if ! .venv/bin/python -c "import orjson, psutil, pybase64, starlette, msgspec, zmq, IPython, uvicorn" 2>/dev/null; then
  .venv/bin/python -m pip install -q -c constraints.txt orjson psutil pybase64 starlette msgspec pyzmq IPython uvicorn
fi
