"""spec.schedule.colocate in a cluster (resources.colocation, topology): refused on GPUs with the
reason, and on CPU the transport the pod network allows, saying why not cuda-ipc."""

from __future__ import annotations

from lockstep.api.rljob import RLJobSpec
from lockstep_operator.resources.colocation import (
    CPU_NOTHING_TO_SHARE,
    colocate_annotation,
    colocation_problem,
)
from lockstep_operator.topology import NodeFacts, choose_transport

MODEL = {"checkpoint": "builtin:tiny", "family": "tiny"}


def _spec(colocate: bool, device: str) -> RLJobSpec:
    return RLJobSpec.model_validate(
        {
            "model": MODEL,
            "data": {"prompts": "builtin:reverse"},
            "schedule": {"colocate": colocate},
            "trainer": {"device": device},
        }
    )


def test_gpu_colocation_is_refused_naming_the_field_and_the_fix() -> None:
    problem = colocation_problem(_spec(True, "cuda"))
    assert problem is not None and problem.startswith("spec.schedule.colocate: ")
    assert "set schedule.colocate to false" in problem and "lockstep run" in problem
    assert colocation_problem(_spec(True, "cpu")) is None
    assert colocation_problem(_spec(False, "cuda")) is None


def test_the_channel_annotation_says_what_is_shared() -> None:
    assert colocate_annotation(_spec(True, "cuda")) == "true"
    assert colocate_annotation(_spec(True, "cpu")) == "cpu"
    assert colocate_annotation(_spec(False, "cpu")) == "false"


def test_cpu_colocation_picks_the_network_and_says_why_not_ipc() -> None:
    node = NodeFacts(name="n", labels={}, allocatable={"cpu": "8"})
    d = choose_transport([node], [node], colocated=False, shared_volume=False, no_ipc=CPU_NOTHING_TO_SHARE)
    assert d.transport == "broadcast"
    assert d.reason.startswith(
        "colocated on CPU: the engine and trainer pods share no device memory, so weights travel over the pod network; "
    )
    asked = choose_transport(
        [node],
        [node],
        colocated=False,
        shared_volume=False,
        requested="cuda-ipc",
        no_ipc=CPU_NOTHING_TO_SHARE,
    )
    assert asked.override_rejected == f"requested transport cuda-ipc is not feasible: {CPU_NOTHING_TO_SHARE}"
