"""spec.model: the policy model of a job or a pool (checkpoint, family, tokenizer, LoRA, BF16 exceptions).

Why it exists: the model section is shared by RLJob, RolloutPool and TrainerGroup, and the runtime's
checkpoint resolver and the operator's init step both ask whether a reference is a hub id; the section
and that question are declared here once.

Who uses it: lockstep.api.rljob (RLJobSpec.model), lockstep.api.rolloutpool, lockstep.api.trainergroup,
lockstep.config.trainer (the model source, the adapter), the operator (the model download step).
"""

from __future__ import annotations

import re
from typing import Annotated, Final

from pydantic import Field

from lockstep.api.common import NAME_PATTERN, ApiModel, Label

ModulePattern = Annotated[str, Field(min_length=1, max_length=256)]


class LoraSpec(ApiModel):
    """Low-rank adapters trained instead of the full weights (peft's LoRA): the base model is frozen and
    never written; only the adapter is trained, checkpointed and synced to the engines, which serve
    base + adapter (SGLang's --enable-lora). docs/lora.md."""

    rank: int = Field(ge=1, le=1024)
    """Adapter rank r. SGLang engines are started with --max-lora-rank at least this."""
    alpha: int = Field(default=16, ge=1, le=4096)
    """Scaling numerator; the adapter output is scaled by alpha / rank."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training (peft's lora_dropout); never applied when
    scoring logprobs or serving."""
    target_modules: list[Label] = Field(default_factory=lambda: ["all-linear"], min_length=1, max_length=64)
    """Module names that get adapters, as peft matches them (`q_proj`, `v_proj`, ...), or `all-linear`
    (every linear layer of the decoder but the output head). A name no module of the model has fails
    the job before any step."""
    adapter_name: str | None = Field(default=None, max_length=40, pattern=NAME_PATTERN)
    """The adapter's name on the engines (each version is loaded as `<name>-v<version>`); unset is the
    job's name. Jobs sharing one rollout pool need different names."""


HUB_ID_PATTERN: Final = (
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}(@[A-Za-z0-9._/-]{1,255})?$"
)
"""A Hugging Face repo id with an optional revision: `org/name` or `org/name@rev` (branch, tag or commit),
the shape the runtime's checkpoint resolver accepts. A local directory in a cluster is an absolute
path, so it never reads as a repo id."""


def is_hub_id(ref: str) -> bool:
    """Whether a checkpoint or tokenizer reference names a hub repo (`org/name[@rev]`), not a local
    directory or `builtin:<name>` (pure)."""
    return re.fullmatch(HUB_ID_PATTERN, ref) is not None and ".." not in ref.split("@", 1)[0]


class SecretKeySelector(ApiModel):
    """One key of a Secret in the job's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    """Secret name."""
    key: str = Field(default="token", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    """Key within the Secret."""


class ModelSpec(ApiModel):
    """The policy model. Immutable after creation: a new model is a new job."""

    checkpoint: str = Field(min_length=1, max_length=1024)
    """Where the initial weights are: a Hugging Face repo id (`Qwen/Qwen3-4B`), a directory holding an
    HF checkpoint (`/models/qwen3-4b`), or `builtin:<name>` for a model that ships with Lockstep and
    needs no download (`builtin:tiny`, a tiny Qwen3-architecture model for CPU runs and tests)."""
    family: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]*$")
    """Model family, lowercase (`qwen3`, `glm5`, ...): picks the chat-template boundary rules of the
    session server and the true-on-policy profile."""
    variant: str | None = Field(default=None, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]*$")
    """Size or variant tag within the family (`0.6b`, `4b`, `744b-a40b`); true-on-policy needs a
    registered family-variant profile."""
    tokenizer: str | None = Field(default=None, max_length=1024)
    """Tokenizer location when it differs from the checkpoint (same forms as checkpoint)."""
    chat_template: str | None = Field(default=None, max_length=1024)
    """Path of a Jinja chat template overriding the tokenizer's own."""
    hub_token_secret: SecretKeySelector | None = None
    """Secret holding a Hugging Face token for a gated or private hub checkpoint (`name`, and `key`,
    default `token`). In a cluster only the init step that downloads the model gets it, as HF_TOKEN
    from the Secret; it is never in job.yaml or the logs."""
    lora: LoraSpec | None = None
    """Train a LoRA adapter instead of the full weights (FSDP backend); unset trains all weights."""
    bf16_modules: list[ModulePattern] = Field(default_factory=list, max_length=256)
    """BF16 exceptions of a low-precision recipe (rollout or trainer precision other than bf16):
    module-name patterns (fnmatch over HF names without `.weight`, e.g. `model.layers.27.*`,
    `*.shared_expert.*`) kept in BF16 at all four stages (conversion, training forward, export,
    rollout). Linear weights whose contraction axis does not fill whole blocks stay BF16 anyway."""
