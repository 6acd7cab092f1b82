"""Reading a SandboxClaim's status (lockstep.sandbox.cluster.ready_pod): the pod an episode runs in is
named by the claim alone (agent-sandbox v1.0.1 runs each Sandbox's pod under the Sandbox's name), so a
claim costs no GET of its Sandbox; a claim is only ready with both the Ready condition and a sandbox."""

from __future__ import annotations

from typing import Any

from lockstep.sandbox.cluster import ready_pod


def _claim(ready: str | None, box: str | None) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if ready is not None:
        status["conditions"] = [{"type": "Ready", "status": ready, "reason": "x"}]
    if box is not None:
        status["sandbox"] = {"name": box, "podIPs": ["10.0.0.9"]}
    return {"metadata": {"name": "c"}, "status": status}


def test_a_ready_claim_names_its_sandboxs_pod() -> None:
    assert ready_pod(_claim("True", "pool-abc12")) == "pool-abc12"


def test_a_claim_is_not_ready_without_the_condition_or_the_sandbox() -> None:
    assert ready_pod(_claim("False", "pool-abc12")) is None
    assert ready_pod(_claim(None, "pool-abc12")) is None
    assert ready_pod(_claim("True", None)) is None
    assert ready_pod({"metadata": {"name": "c"}}) is None
