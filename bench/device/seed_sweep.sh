#!/bin/bash
# A seed sweep (bench/seed_sweep.py) on the lent GPU machine's 16 CPU cores, from this checkout.
#
# Why: a sweep of the sandbox example takes ~45 min a seed on the shared 2-core dev machine and ~4 min
# (5 seeds at once) on the lent machine's quiet cores. That machine has Python 3.12 with torch and
# transformers but none of Lockstep's other dependencies and no network, and a command may run 10 min.
#
# Here (network):     bash bench/device/seed_sweep.sh wheels            (cp312 wheels into .devrun/sbx/whl,
#                                                                          the versions of constraints.txt)
# Device call 1:      MANIFEST=.devrun/sbx/manifest.yaml SEEDS="7 1234 0 1 2" LABEL=x PAR=5 THREADS=3 \
#                       bash bench/device/seed_sweep.sh start          (installs, starts the sweep in its own
#                                                                          session: it outlives the call)
# Device calls 2..:   bash bench/device/seed_sweep.sh wait 500          (waits, copies the .md/.json to $OUT)
# (run's carry: [".devrun/sbx"]; calls less than the machine's idle release apart keep it warm.)
set -u
cd "$(dirname "$0")/../.."
W=/tmp/sweep
PKGS="aiohappyeyeballs aiohttp aiosignal annotated-types anyio attrs blake3 certifi contourpy cycler
fonttools frozenlist h11 httpcore httpcore2 httpx httpx2 idna jiter kiwisolver matplotlib multidict openai
pillow prometheus-client propcache pydantic pydantic-core pyparsing python-dateutil pyyaml sniffio tqdm
truststore typing-extensions typing-inspection xxhash yarl zstandard"
case "${1:-}" in
wheels)
  mkdir -p .devrun/sbx/whl
  for p in $PKGS; do
    pin=$(grep -iE "^${p//-/[-_]}==" constraints.txt || echo "$p")
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 "$pin" -d .devrun/sbx/whl || exit 1
  done
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 distro six \
    -d .devrun/sbx/whl || exit 1 ;;
start)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .devrun/sbx/whl/*.whl || exit 9
  rm -rf $W && mkdir -p $W
  (nproc; uptime; python3 -c "import sys, torch; print(sys.version, torch.__version__)") > $W/env.txt 2>&1
  PYTHONPATH=/tmp/site:$PWD/runtime:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 setsid bash -c \
    "python3 bench/seed_sweep.py --manifest $MANIFEST --seeds $SEEDS --label $LABEL --out $W --parallel $PAR \
     --threads $THREADS > $W/sweep.log 2>&1; echo rc=\$? >> $W/sweep.log; touch $W/done" < /dev/null > /dev/null 2>&1 &
  sleep 20 ;;
wait)
  end=$((SECONDS + ${2:-500}))
  while [ ! -e $W/done ] && [ $SECONDS -lt $end ]; do sleep 10; done ;;
*) echo "usage: $0 wheels | start | wait [SECONDS]" >&2; exit 2 ;;
esac
[ "${1}" = wheels ] || { cp $W/*.md $W/*.json $W/*.log $W/env.txt "${OUT:-/tmp}/" 2>/dev/null; grep -v "Loading weights" $W/sweep.log | tail -5; }
