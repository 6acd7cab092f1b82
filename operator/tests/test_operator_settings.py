"""Settings come from the environment once; a bad value names its variable."""

from __future__ import annotations

import pytest
from lockstep_operator.settings import settings_from_env


def test_defaults_and_overrides() -> None:
    s = settings_from_env({"LOCKSTEP_OPERATOR_NAMESPACES": "a, b", "LOCKSTEP_OPERATOR_RESYNC_SECONDS": "2.5"})
    assert s.namespaces == ("a", "b") and s.resync_seconds == 2.5 and s.ha_mode == "peering"


def test_bad_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="LOCKSTEP_OPERATOR_HA_MODE"):
        settings_from_env({"LOCKSTEP_OPERATOR_HA_MODE": "raft"})


def test_a_service_link_colliding_with_a_setting_names_the_fix() -> None:
    """A Service `lockstep-operator-metrics` in the operator's namespace makes the kubelet set
    LOCKSTEP_OPERATOR_METRICS_PORT=tcp://IP:9090 in its pod (service links)."""
    with pytest.raises(
        ValueError,
        match=r"LOCKSTEP_OPERATOR_METRICS_PORT=tcp://10\.0\.0\.7:9090 is a Kubernetes service link",
    ):
        settings_from_env({"LOCKSTEP_OPERATOR_METRICS_PORT": "tcp://10.0.0.7:9090"})
    with pytest.raises(ValueError) as refused:
        settings_from_env({"LOCKSTEP_OPERATOR_METRICS_PORT": "nine"})
    assert "enableServiceLinks" not in str(refused.value)


def test_kopf_arguments_and_peering_priority() -> None:
    from lockstep_operator.__main__ import kopf_kwargs

    standalone = kopf_kwargs(
        settings_from_env({"LOCKSTEP_OPERATOR_HA_MODE": "standalone", "LOCKSTEP_OPERATOR_NAMESPACES": "a"})
    )
    assert standalone == {
        "standalone": True,
        "namespaces": ["a"],
        "liveness_endpoint": "http://0.0.0.0:8080/healthz",
    }
    peering = settings_from_env({"LOCKSTEP_OPERATOR_HEALTH_PORT": "0"})
    one, two = kopf_kwargs(peering, "op-abc"), kopf_kwargs(peering, "op-xyz")
    assert one["peering_name"] == "lockstep-operator" and one["clusterwide"] is True
    assert (
        one["priority"] != two["priority"] and one["priority"] == kopf_kwargs(peering, "op-abc")["priority"]
    )
    assert kopf_kwargs(settings_from_env({"LOCKSTEP_OPERATOR_PRIORITY": "7"}), "x")["priority"] == 7


def test_peering_lifetime_is_a_setting() -> None:
    assert settings_from_env({}).peering_lifetime_seconds == 60  # kopf's default
    assert (
        settings_from_env({"LOCKSTEP_OPERATOR_PEERING_LIFETIME_SECONDS": "4"}).peering_lifetime_seconds == 4
    )
    with pytest.raises(ValueError, match="LOCKSTEP_OPERATOR_PEERING_LIFETIME_SECONDS"):
        settings_from_env({"LOCKSTEP_OPERATOR_PEERING_LIFETIME_SECONDS": "0"})
