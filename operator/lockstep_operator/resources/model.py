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

Low-precision serving (spec.rollout.precision fp8 | mxfp8 | nvfp4, §6 stage 1): engine pods
serve the checkpoint converted by the job's recipe, never the BF16 one. Each engine pod gets a
`serving` volume at SERVING_MOUNT and a second init step, `lockstep convert-model SRC --dest DIR`
(after the pull when there is one), which writes the converted checkpoint atomically into
`serving_dir(model, precision)`; the engine command then names that directory. On the job's shared
claim the directory is converted once and later pods find it in place. Trainer ranks and the driver
keep reading the BF16 checkpoint (they train it; every push is quantized by the same recipe).

Who calls it: resources.pods (the init containers and the volumes), the driver, rank and engine
builders and the RLJob reconcile (job.yaml); golden- and table-tested in operator/tests.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import dataclass

from lockstep.api.rljob import ModelSpec, Precision, SecretKeySelector, is_hub_id

MODEL_MOUNT = "/models"
"""Where the model volume is mounted in every container of a pod."""
MODEL_VOLUME = "model"
"""The pod volume's name (an emptyDir when the job has no shared claim)."""
SHARED_SUBPATH = "lockstep/models"
"""The model directory inside the job's shared claim."""
SERVING_MOUNT = "/serving"
"""Where the converted (low-precision) serving checkpoints are mounted in an engine pod."""
SERVING_VOLUME = "serving"
"""The engine pod's volume for them (an emptyDir when the job has no shared claim)."""
SERVING_SUBPATH = "lockstep/serving"
"""Their directory inside the job's shared claim."""


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


@dataclass(frozen=True, slots=True)
class ModelConvert:
    """What an engine pod's conversion step reads and writes (§6 stage 1)."""

    src: str
    """The BF16 checkpoint directory as the pod sees it (the model volume's, or a local path)."""
    dest: str
    """The serving checkpoint directory under SERVING_MOUNT (`serving_dir`)."""
    precision: Precision
    """spec.rollout.precision (not bf16)."""
    bf16_modules: tuple[str, ...]
    """spec.model.bf16Modules: the recipe's exceptions, kept in BF16."""
    image: str
    """Image with the `lockstep` CLI (the runtime image, which reads local checkpoints as the ranks do)."""


SERVING_LAYOUT = 2
"""Version of the converted checkpoint's layout, part of `serving_dir`'s key: bump it when the
conversion writes other tensors for the same recipe, so a shared volume's older conversion is never
served to engines that receive the new layout (2: expert weights quantized per expert, NVFP4's
input_scale and one weight_scale_2 per fused layer)."""


def serving_dir(model: ModelSpec, precision: Precision) -> str:
    """The directory holding `model` converted to `precision` (pure and stable: every engine pod of
    the job agrees, and a different recipe or conversion layout never reuses another's files)."""
    key = json.dumps(
        {
            "checkpoint": model.checkpoint,
            "precision": precision.value,
            "bf16Modules": list(model.bf16_modules),
            "layout": SERVING_LAYOUT,
        },
        sort_keys=True,
    )
    return f"{SERVING_MOUNT}/{precision.value}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def model_convert(model: ModelSpec, precision: Precision, image: str) -> ModelConvert | None:
    """The conversion step an engine serving `precision` needs (None for bf16: the checkpoint as is)."""
    if precision is Precision.BF16:
        return None
    return ModelConvert(
        src=local_model(model).checkpoint,
        dest=serving_dir(model, precision),
        precision=precision,
        bf16_modules=tuple(model.bf16_modules),
        image=image,
    )


def serving_model(model: ModelSpec, precision: Precision) -> ModelSpec:
    """`model` as an engine serving `precision` reads it: local directories, and the converted
    checkpoint (its own copy of the tokenizer files) when the precision is not bf16."""
    local = local_model(model)
    if precision is Precision.BF16:
        return local
    return local.model_copy(update={"checkpoint": serving_dir(model, precision)})


def convert_command(convert: ModelConvert) -> list[str]:
    """`lockstep convert-model SRC --dest DIR --precision P [--bf16-modules ...]` (runtime/lockstep/cli)."""
    cmd = [
        "lockstep",
        "convert-model",
        convert.src,
        "--dest",
        convert.dest,
        "--precision",
        convert.precision.value,
    ]
    if convert.bf16_modules:
        cmd += ["--bf16-modules", *convert.bf16_modules]
    return cmd
