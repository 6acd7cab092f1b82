"""Kubernetes client helpers of the operator: `client` (server-side apply, get, list) and `owners`."""
