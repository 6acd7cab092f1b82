#!/bin/sh
# The one install step of every Lockstep image: the Dockerfiles in this directory run it, and so does
# the image build without Docker (e2e/controlplane/node/runtime_image.py, `make images`), so an image
# built either way holds the same files. Versions come from constraints.txt (what `make test` passed
# with), never from whatever PyPI serves that day.
#
#   install.sh deps    EXTRAS PREFIX [PIP OPTION...]   third-party packages of lockstep[EXTRAS]
#   install.sh package EXTRAS PREFIX [PIP OPTION...]   the lockstep package itself and its commands
#   install.sh onbase  EXTRAS                          lockstep[EXTRAS] into the running Python,
#                                                      keeping every version the base image has
#
# deps/package install into PREFIX/lib/python3.11/site-packages (a virtual environment at PREFIX: the
# commands in PREFIX/bin run PREFIX/bin/python). Two steps so that an image's gigabytes of dependencies
# are one layer, rebuilt only when constraints.txt or the extras change, and the package a small one
# above it. PIP OPTIONs go to pip: the build without Docker passes --platform/--python-version/
# --only-binary to install another architecture's wheels (arm64 for GB300) from this machine.
# `onbase` is for images built on SGLang's image (engine, trainer-sglang): SGLang pins the torch,
# transformers and kernels it was built with, so the base's versions are constraints too and pip fails
# (instead of changing the base) when lockstep would need another version.
# Run from anywhere; the repository is this script's parent directory. $PIP: the pip to run
# (default `python3 -m pip`). $DESTDIR: install under $DESTDIR$PREFIX while the commands name PREFIX
# (the build without Docker assembles the image's tree in a directory of this machine).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
mode=${1:?mode: deps, package or onbase}
extras=${2-}
pip=${PIP:-python3 -m pip}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# lockstep's requirements for EXTRAS, read from pyproject.toml (no build needed, so the dependency
# layer does not depend on the sources).
requirements() {
  python3 - "$repo/pyproject.toml" "$extras" <<'EOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = list(project["dependencies"])
for extra in filter(None, sys.argv[2].split(",")):
    if extra not in project["optional-dependencies"]:
        sys.exit(f"install.sh: pyproject.toml has no extra {extra!r}")
    reqs += project["optional-dependencies"][extra]
print("\n".join(reqs))
EOF
}

wheel() {  # the lockstep wheel (pure Python) into $work/wheel
  $pip wheel --quiet --no-deps --no-cache-dir --wheel-dir "$work/wheel" "$repo" >&2
  ls "$work"/wheel/lockstep-*.whl
}

case $mode in
deps | package)
  prefix=${3:?PREFIX}
  shift 3
  dest=${DESTDIR-}$prefix
  site="$dest/lib/python3.11/site-packages"
  mkdir -p "$site" "$dest/bin"
  if [ "$mode" = deps ]; then
    requirements >"$work/requirements.txt"
    $pip install --no-cache-dir --no-compile --disable-pip-version-check --target "$site" \
      -c "$repo/constraints.txt" -r "$work/requirements.txt" "$@"
  else
    $pip install --no-cache-dir --no-compile --disable-pip-version-check --no-deps --target "$site" \
      "$(wheel)" "$@"
    # The commands, as `pip install` into the environment would write them (pip --target writes
    # them with this machine's interpreter, so they are written here for the image's).
    for entry in "lockstep=lockstep.cli" "lockstep-operator=lockstep_operator.__main__" \
      "torchrun=torch.distributed.run"; do
      name=${entry%%=*}
      module=${entry#*=}
      case $name in torchrun) [ -d "$site/torch" ] || continue ;; esac
      printf '#!%s/bin/python\nimport sys\nfrom %s import main\nsys.exit(main())\n' "$prefix" "$module" \
        >"$dest/bin/$name"
      chmod 755 "$dest/bin/$name"
    done
  fi
  rm -rf "$site/bin" # pip --target's copies of the commands, with this machine's interpreter
  ;;
onbase)
  # Every installed version is a constraint; constraints.txt adds the versions of what the base lacks.
  $pip freeze --all --exclude-editable | sed 's/ @ .*//' >"$work/base.txt"
  sed 's/[=<>!~ ].*//' "$work/base.txt" | tr 'A-Z_.' 'a-z--' | sort -u >"$work/base-names"
  while IFS= read -r line; do
    case $line in '#'* | '') continue ;; esac
    name=$(printf '%s' "${line%%=*}" | tr 'A-Z_.' 'a-z--')
    grep -qx "$name" "$work/base-names" || printf '%s\n' "$line"
  done <"$repo/constraints.txt" >"$work/rest.txt"
  $pip install --no-cache-dir -c "$work/base.txt" -c "$work/rest.txt" "$(wheel)${extras:+[$extras]}"
  ;;
*)
  echo "install.sh: unknown mode $mode (deps, package or onbase)" >&2
  exit 2
  ;;
esac
