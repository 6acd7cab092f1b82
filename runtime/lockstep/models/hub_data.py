"""Hub dataset ids as prompt sources: `spec.data.prompts: org/name[@rev][:config][:split]`.

Why it exists: users name datasets the way they name models, by their Hugging Face id. A prompt
source that is not a local path (nor `builtin:`) but an id resolves like a repo-id checkpoint
(lockstep.models.checkpoint): huggingface_hub fetches the dataset repo's data files and card into its
own cache (HF_HOME / HF_HUB_CACHE, HF_ENDPOINT, HF_TOKEN never logged); with HF_HUB_OFFLINE=1 only
the cached snapshot is used and a missing one is a CheckpointError naming the dataset and the cache
(`lockstep run` exits 2). The snapshot directory is then an ordinary local dataset repo copy, read by
lockstep.tasks.data with the same `:config:split` suffix (e.g. `openai/gsm8k:main:test`; `@rev` is
the revision, as for models). A local path always wins over an id of the same spelling.

In a cluster the pods that read prompts resolve the id themselves (no init step yet); for a gated
dataset or a cluster without the hub, `lockstep pull-model --dataset REF --dest DIR` into the image
and spec.data.prompts: DIR (docs/operator.md, "Hub checkpoints: the model volume").

Who calls it: lockstep.driver.inputs, lockstep.trainer.parts, lockstep.trainer.standalone (resolve_data
before lockstep.tasks.data_task), lockstep.cli.precision, lockstep.cli.pull_model.
"""

from __future__ import annotations

from pathlib import Path

from lockstep.api import DataSpec
from lockstep.models.checkpoint import HubRef, parse_hub_ref, snapshot

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv")
"""A source ending in one of these is a (missing) file, never a dataset id: its error says so."""
DATA_PATTERNS = ("*.parquet", "*.arrow", "*.jsonl", "*.json", "*.csv", "README.md")
"""Files fetched from a dataset repo: data files and the card that declares its configs (no scripts)."""


def parse_dataset_ref(source: str) -> tuple[HubRef, str] | None:
    """`org/name[@rev][:config][:split]` -> (repo ref, the `:...` suffix, possibly empty); None when
    `source` is a builtin, an existing path, or not a repo id."""
    if source.startswith("builtin:") or Path(source).expanduser().exists() or source.endswith(FILE_SUFFIXES):
        return None
    head, sep, suffix = source.partition(":")
    ref = parse_hub_ref(head)
    if ref is None or suffix.count(":") > 1 or (sep and not all(suffix.split(":"))):
        return None
    return ref, sep + suffix


def resolve_prompts(source: str) -> str:
    """A prompt source with a hub dataset id replaced by its local snapshot (suffix kept); other
    sources unchanged. Raises CheckpointError naming the dataset and the cache."""
    parsed = parse_dataset_ref(source)
    if parsed is None:
        return source
    ref, suffix = parsed
    return f"{snapshot(ref, repo_type='dataset', allow_patterns=DATA_PATTERNS)}{suffix}"


def resolve_data(data: DataSpec) -> DataSpec:
    """spec.data with its hub dataset ids resolved to local snapshots (prompts and evalPrompts)."""
    update = {"prompts": resolve_prompts(data.prompts)}
    if data.eval_prompts is not None:
        update["eval_prompts"] = resolve_prompts(data.eval_prompts)
    return data.model_copy(update=update)
