# The README's two commands are `make run` (set up ./.venv, run the main job on the embedded default)
# and `make test` (set up, build the local control plane once, run every check and test). `make check`
# is the fast inner loop on an already set-up ./.venv: lint, format, types, imports, CRD drift and the
# unit tests that need no cluster and start no heavy process (<= 5 min warm on 2 cores);
# .pre-commit-config.yaml runs the same checks.
PY := .venv/bin/python
MANIFEST ?= examples/tiny-local.yaml

.PHONY: setup run test check unit lint typecheck imports crds crds-check controlplane pytest realnode test-realnode lock images

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

# The control plane's binaries, and Prometheus + promtool for the monitoring tests (from its pinned
# Go module, into the same cache: e2e/controlplane/prometheus/install.sh).
controlplane:
	bash e2e/controlplane/build.sh
	bash e2e/controlplane/prometheus/install.sh

# A real worker node (kubelet, containerd, CNI, CoreDNS, images built here) and its e2e tests, part of
# `make test` wherever the machine can run containers; elsewhere node/probe.py prints one line saying
# what is missing and the real-node tests skip (exit 3: skip; 2: LOCKSTEP_REAL_NODE=1 but it cannot).
realnode: controlplane
	@$(PY) -m e2e.controlplane.node.probe; rc=$$?; \
	  if [ $$rc = 0 ]; then bash e2e/controlplane/node/build.sh; elif [ $$rc != 3 ]; then exit $$rc; fi

test-realnode: setup realnode
	LOCKSTEP_REAL_NODE=1 $(PY) -m pytest e2e/test_realnode.py e2e/test_realpods.py

# The operator and runtime images, each one multi-architecture OCI archive (amd64 + arm64) under
# dist/images/, built without Docker by the Dockerfiles' recipe (images/README.md; needs root for
# mmdebstrap). Push one with `skopeo copy --all oci-archive:dist/images/FILE docker://REGISTRY/NAME:TAG`.
# IMAGES=operator or ARCHES=amd64 narrow it.
IMAGES ?= operator runtime
ARCHES ?= amd64 arm64
images: setup
	$(PY) -m e2e.controlplane.node.runtime_image $(addprefix --image ,$(IMAGES)) $(addprefix --arch ,$(ARCHES))

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

typecheck:
	.venv/bin/mypy

imports:
	.venv/bin/lint-imports

# The CRDs go to crds/ (kustomize: manifests/) and the Helm chart's crds/ alike.
crds:
	$(PY) -m lockstep.api.crdgen --out crds
	$(PY) -m lockstep.api.crdgen --out charts/lockstep/crds

crds-check:
	$(PY) -m lockstep.api.crdgen --out crds --check
	$(PY) -m lockstep.api.crdgen --out charts/lockstep/crds --check

pytest:
	$(PY) -m pytest $(call DURATIONS,test)

# Every measured run saves its per-test durations under bench/results (bench/pytest_durations.py).
DURATIONS = -p bench.pytest_durations --durations-file bench/results/pytest_durations_{date}_cpu_$(1).md

# Unit tests without a cluster, a GPU or a heavy process (markers e2e, gpu, slow, heavy: pyproject.toml).
unit:
	$(PY) -m pytest runtime/tests operator/tests -q -m "not e2e and not gpu and not slow and not heavy" \
	  $(call DURATIONS,check)

check: lint typecheck imports crds-check unit

test: setup controlplane realnode lint typecheck imports crds-check pytest
