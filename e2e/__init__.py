"""End-to-end tests against a real local Kubernetes control plane (see docs/controlplane.md).

A package so that test helpers import as `e2e.controlplane...` from the repository root.
"""
