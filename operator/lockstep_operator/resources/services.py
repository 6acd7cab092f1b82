"""Service builders: the router in front of a pool's engines and the headless rendezvous Service.

Why it exists: the driver reaches the engines through one stable address (the router Service,
ClusterIP, only Ready engines behind it), and trainer ranks reach rank 0 through stable per-pod DNS
names (`<trainer>-<rank>.<trainer>.<ns>.svc`) that only a headless Service whose name equals the pods'
subdomain provides. Called by the RolloutPool and TrainerGroup reconciles.
"""

from __future__ import annotations

from collections.abc import Mapping

from lockstep_operator.resources.common import (
    CONTROL_PORT,
    ENGINE_PORT,
    RENDEZVOUS_PORT,
    Manifest,
    Owner,
    job_labels,
    metadata,
)


def router_service(owner: Owner, *, job: str, name: str, selector: Mapping[str, str]) -> Manifest:
    """ClusterIP Service `name` on port 30000 over the pool's Ready engine pods."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, name, job_labels(job, "engine")),
        "spec": {
            "type": "ClusterIP",
            "selector": dict(selector),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": ENGINE_PORT, "protocol": "TCP"}],
        },
    }


def headless_service(owner: Owner, *, job: str, name: str, selector: Mapping[str, str]) -> Manifest:
    """Headless Service `name` (= the rank pods' subdomain); publishes not-ready pods for rendezvous.

    Ports: rendezvous (29500, MASTER_PORT) and control (29600, rank 0's endpoint for the driver).
    """
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, name, job_labels(job, "trainer")),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": dict(selector),
            "ports": [
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT},
                {"name": "control", "port": CONTROL_PORT, "targetPort": CONTROL_PORT},
            ],
        },
    }


def engines_service(owner: Owner, *, job: str, name: str, selector: Mapping[str, str]) -> Manifest:
    """Headless Service `name` over every engine of the pool, not-ready ones included.

    The router Service only has Ready engines behind it, and an engine is Ready only once it holds the
    current weight version; so whoever must reach the others (the driver asking each engine for its
    version, weight pushes to a new engine) resolves this name to every engine's pod IP.
    """
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, name, job_labels(job, "engine")),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": dict(selector),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": ENGINE_PORT, "protocol": "TCP"}],
        },
    }
