"""The local Kubernetes control plane of the e2e tests: build (build.sh), run (cluster.py), nodes, stages.

Used by e2e/conftest.py, bench/controlplane_start.py and `python -m e2e.controlplane` (start.sh/stop.sh).
"""
