"""The model volume of a job whose checkpoint is a Hugging Face repo id: one init step fills it (pure).

Why it exists: pods must not each talk to the hub in their own way (SGLang would download on its own,
the runtime through its cache), and a hub token must reach only the step that downloads. So when
spec.model.checkpoint (or spec.model.tokenizer) is `org/name` or `org/name@rev`, every pod of the job
(driver, trainer ranks, engines) gets a `model` volume at MODEL_MOUNT, filled by an init container
running `lockstep pull-model REF --dest DIR` (exit 2 on failure, its message kept as the container's
termination message) with HF_TOKEN from spec.model.hubTokenSecret; the main container then reads
the local directory: job.yaml and the engine command carry `local_model(model)`, never the repo id.
The volume is the job's shared ReadWriteMany claim when it has one (filled once, later pods find the
files in place), else an emptyDir per pod.

Who calls it: resources.pods (the init container and the volume), the driver, rank and engine
builders and the RLJob reconcile (job.yaml); golden- and table-tested in operator/tests.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from lockstep.api.rljob import ModelSpec, SecretKeySelector, is_hub_id

MODEL_MOUNT = "/models"
"""Where the model volume is mounted in every container of a pod."""
MODEL_VOLUME = "model"
"""The pod volume's name (an emptyDir when the job has no shared claim)."""
SHARED_SUBPATH = "lockstep/models"
"""The model directory inside the job's shared claim."""


@dataclass(frozen=True, slots=True)
class ModelPull:
    """What a pod's init step downloads, with what credentials and image."""

    refs: tuple[str, ...]
    """The hub references to fetch (checkpoint, then tokenizer when it is another repo)."""
    image: str
    """Image with the `lockstep` CLI (the runtime image; an engine's SGLang image need not have it)."""
    token: SecretKeySelector | None = None
    """Secret key exposed to the init step only, as HF_TOKEN."""


def local_dir(ref: str) -> str:
    """The directory under MODEL_MOUNT holding hub reference `ref` (`org/name@rev` ->
    /models/org--name@rev; pure and stable, so every pod of the job agrees)."""
    return f"{MODEL_MOUNT}/{re.sub(r'[^A-Za-z0-9._@-]', '--', ref)}"


def local_model(model: ModelSpec) -> ModelSpec:
    """`model` with every hub reference replaced by its local directory (what the runtime and SGLang
    read); unchanged when nothing comes from the hub."""
    update = {
        name: local_dir(ref)
        for name, ref in (("checkpoint", model.checkpoint), ("tokenizer", model.tokenizer))
        if ref is not None and is_hub_id(ref)
    }
    return model.model_copy(update=update) if update else model


def model_pull(model: ModelSpec, image: str) -> ModelPull | None:
    """The init step `model` needs (None when nothing comes from the hub)."""
    refs = tuple(
        dict.fromkeys(r for r in (model.checkpoint, model.tokenizer) if r is not None and is_hub_id(r))
    )
    return ModelPull(refs=refs, image=image, token=model.hub_token_secret) if refs else None


def pull_command(pull: ModelPull) -> list[str]:
    """`lockstep pull-model REF --dest DIR` per reference; several run in one shell, stopping at the
    first failure."""
    steps = [["lockstep", "pull-model", ref, "--dest", local_dir(ref)] for ref in pull.refs]
    return steps[0] if len(steps) == 1 else ["sh", "-c", " && ".join(shlex.join(s) for s in steps)]
