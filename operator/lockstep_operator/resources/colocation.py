"""What spec.schedule.colocate means in a cluster (pure).

Why it exists: colocation promises that the trainer rank and its engine share the device, so weights
move by CUDA IPC (seed §7.2). The operator renders engines and trainer ranks as separate pods, each
requesting its own GPUs, and a GPU granted to one container is not visible in another, so a CUDA IPC
handle could never be opened as rendered. Rather than choose a transport that cannot work, or quietly
spend separate GPUs on a job that asked to share them, a GPU job with colocate is refused with the
reason (condition Failed/InvalidSpec). On CPU there is no device memory to share: the pods run as
rendered and the WeightChannel picks the transport the pod network allows (broadcast over gloo, or
disk-delta with a shared volume), saying so in its reason. `lockstep run` on one machine keeps
colocation (the in-process engine and the trainer share host memory; with a separate CUDA engine,
CUDA IPC), which is where CUDA IPC is proven (its GPU tests).

Who calls it: reconcile.rljob (the refusal), resources.children (the channel's colocate annotation).
"""

from __future__ import annotations

from lockstep.api.rljob import Device, RLJobSpec

GPU_COLOCATION_REFUSED = (
    "spec.schedule.colocate: the operator renders engines and trainer ranks as separate pods, each with "
    "its own GPUs, so they cannot share a device and CUDA IPC cannot reach across them: set "
    "schedule.colocate to false (the WeightChannel then picks broadcast, p2p or disk-delta from the "
    "nodes), or run colocated on one machine with `lockstep run`"
)

CPU_NOTHING_TO_SHARE = (
    "colocated on CPU: the engine and trainer pods share no device memory, so weights travel over the pod "
    "network"
)
"""Why the WeightChannel does not choose cuda-ipc for a colocated CPU job."""


def colocation_problem(spec: RLJobSpec) -> str | None:
    """The reason a colocated job cannot run as rendered in a cluster; None when it can."""
    if spec.schedule.colocate and spec.trainer.device is Device.CUDA:
        return GPU_COLOCATION_REFUSED
    return None


def colocate_annotation(spec: RLJobSpec) -> str:
    """The WeightChannel's colocate annotation: "true" (shares GPUs), "cpu" (colocated on CPU: nothing
    to share across pods), "false"."""
    if not spec.schedule.colocate:
        return "false"
    return "cpu" if spec.trainer.device is Device.CPU else "true"
