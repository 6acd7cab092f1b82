# The README's two commands are `make run` (set up ./.venv, run the main job on the embedded default)
# and `make test` (set up, build the local control plane once, run every check and test).
PY := .venv/bin/python
MANIFEST ?= examples/tiny-local.yaml

.PHONY: setup run test lint typecheck imports crds crds-check controlplane pytest realnode test-realnode lock

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/lockstep run $(MANIFEST)

# The newest releases within pyproject.toml's ranges into ./.venv, frozen into constraints.txt (then run
# `make test` and commit both).
lock: setup
	.venv/bin/python -m pip install -q -U -e ".[runtime,p2p,megatron,dev]"
	{ sed -n '/^#/p' constraints.txt; .venv/bin/python -m pip freeze --exclude-editable; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

controlplane:
	bash e2e/controlplane/build.sh

# A real worker node (kubelet, containerd, CNI, CoreDNS, images built here) and its e2e tests, part of
# `make test` wherever the machine can run containers; elsewhere node/probe.py prints one line saying
# what is missing and the real-node tests skip (exit 3: skip; 2: LOCKSTEP_REAL_NODE=1 but it cannot).
realnode: controlplane
	@$(PY) -m e2e.controlplane.node.probe; rc=$$?; \
	  if [ $$rc = 0 ]; then bash e2e/controlplane/node/build.sh; elif [ $$rc != 3 ]; then exit $$rc; fi

test-realnode: setup realnode
	LOCKSTEP_REAL_NODE=1 $(PY) -m pytest e2e/test_realnode.py e2e/test_realpods.py

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

typecheck:
	.venv/bin/mypy

imports:
	.venv/bin/lint-imports

crds:
	$(PY) -m lockstep.api.crdgen --out crds

crds-check:
	$(PY) -m lockstep.api.crdgen --out crds --check

pytest:
	$(PY) -m pytest

test: setup controlplane realnode lint typecheck imports crds-check pytest
