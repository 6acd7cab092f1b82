"""The trainer's node-local directory (spec.trainer.localDisk) as a volume of each rank pod (pure).

Why it exists: disk offload and the streamed optimizer state need a fast local disk (the node's NVMe),
not the container's writable layer. `hostPath` mounts the node's directory (DirectoryOrCreate: kept
across pods, so a restarted gang finds the node's disk as it left it); `ephemeral` is a generic
ephemeral volume: a PersistentVolumeClaim of `size` from `storageClassName` (e.g. a local-NVMe
provisioner) created with the pod and deleted with it. Either is mounted at `path`, which is also
where the trainer process looks (lockstep.train.factory), so one machine and a pod read the same
field. A hostPath volume is outside Pod Security "restricted"; the ephemeral one is not.

Who calls it: resources.ranks.
"""

from __future__ import annotations

from lockstep.api.rljob import LocalDiskSource, LocalDiskSpec

from lockstep_operator.resources.common import Manifest

VOLUME = "local-disk"


def local_disk_volume(spec: LocalDiskSpec) -> tuple[Manifest, Manifest]:
    """(volume, volumeMount) of the rank pod's node-local directory."""
    volume: Manifest
    if spec.source is LocalDiskSource.HOST_PATH:
        volume = {"name": VOLUME, "hostPath": {"path": spec.path, "type": "DirectoryOrCreate"}}
    else:
        claim: Manifest = {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": spec.size}},
        }
        if spec.storage_class_name:
            claim["storageClassName"] = spec.storage_class_name
        volume = {"name": VOLUME, "ephemeral": {"volumeClaimTemplate": {"spec": claim}}}
    return volume, {"name": VOLUME, "mountPath": spec.path}
