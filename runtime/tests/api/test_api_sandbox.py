"""spec.agent.sandbox: defaults, and the concurrency and warm-pool sizes derived from the job."""

from __future__ import annotations

from lockstep.api import SandboxSpec, sandbox_concurrency, warm_pool_size


def test_defaults_deny_egress_and_size_the_pool_from_the_rollout() -> None:
    spec = SandboxSpec(image="busybox")
    assert spec.egress == "deny" and spec.working_dir == "/workspace"
    assert spec.wire() == {
        "image": "busybox",
        "workingDir": "/workspace",
        "commandTimeoutSeconds": 60,
        "outputLimitBytes": 4096,
        "resources": {"cpu": "1", "memory": "1Gi", "ephemeralStorage": "1Gi"},
        "egress": "deny",
    }
    # sync: one step's episodes, capped by maxInFlight; fully-async: maxInFlight
    assert sandbox_concurrency(sandbox=spec, max_in_flight=64, samples_per_step=16, fully_async=False) == 16
    assert sandbox_concurrency(sandbox=spec, max_in_flight=8, samples_per_step=16, fully_async=False) == 8
    assert sandbox_concurrency(sandbox=spec, max_in_flight=128, samples_per_step=64, fully_async=True) == 128
    assert warm_pool_size(spec, 16) == 16


def test_explicit_sizes_win() -> None:
    spec = SandboxSpec(image="busybox", maxSandboxes=3, warmPool=1)
    assert sandbox_concurrency(sandbox=spec, max_in_flight=64, samples_per_step=64, fully_async=False) == 3
    assert warm_pool_size(spec, 3) == 1
    assert warm_pool_size(SandboxSpec(image="busybox", warmPool=0), 3) == 0
