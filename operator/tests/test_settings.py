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
