"""Where a model comes from: `spec.model.checkpoint` / `spec.model.tokenizer` -> a local HF-layout dir.

Why it exists: users have Hugging Face checkpoints, either on a volume (a directory) or on the hub (a
repo id). Three forms are accepted, checked in this order:
- `builtin:<name>`: a checkpoint that ships with Lockstep, materialized once (lockstep.models.tiny);
- a directory in HF layout (config.json, *.safetensors with model.safetensors.index.json when
  sharded, tokenizer.json, tokenizer_config.json, generation_config.json): used where it is;
- a hub repo id with an optional revision, `org/name` or `org/name@rev`: fetched by huggingface_hub
  into its own cache (HF_HOME / HF_HUB_CACHE, HF_ENDPOINT, the token in HF_TOKEN, never logged).
  With HF_HUB_OFFLINE=1 only the cached snapshot is used; a missing one is a CheckpointError naming
  the repo and the cache. In a cluster the operator's init step runs `lockstep pull-model` once into
  the job's model volume and the pods read that directory.

Only what a run reads is fetched: configs, safetensors shards, tokenizer and template files (no
PyTorch pickles: .bin/.pt are never loaded).

Who calls it: lockstep.driver, lockstep.trainer, the CLI (run, engine, trainer, pull-model).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from lockstep.api.rljob import is_hub_id
from lockstep.models.tiny import BUILTIN_PREFIX, builtin_dir
from lockstep.models.tokenizer import TOKENIZER_FILES, ChatTokenizer

ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model")
"""Files fetched from the hub: configs, weights, tokenizer, chat template (never pickles or code)."""


class CheckpointError(ValueError):
    """A model reference that cannot be resolved; the message names the repo or path and the fix."""


@dataclass(frozen=True, slots=True)
class HubRef:
    """A Hugging Face repo id with an optional revision (branch, tag or commit)."""

    repo_id: str
    """`org/name`."""
    revision: str | None = None
    """What follows `@`, or None for the repo's default branch."""

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_hub_ref(ref: str) -> HubRef | None:
    """`org/name[@rev]` -> HubRef; None when `ref` is not a repo id (the API's rule, lockstep.api.rljob
    .is_hub_id, so the operator's model volume and the runtime agree on what comes from the hub)."""
    if not is_hub_id(ref) or ".." in ref:
        return None
    repo, _, revision = ref.partition("@")
    return HubRef(repo, revision or None)


def hub_cache_dir() -> Path:
    """huggingface_hub's cache as the environment says now (HF_HUB_CACHE, else $HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "huggingface"
    )
    return Path(home) / "hub"


def offline() -> bool:
    """True when HF_HUB_OFFLINE asks for the cache only (1/true/yes/on)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_checkpoint(model: str, cache_dir: str | os.PathLike[str] | None = None, seed: int = 0) -> Path:
    """A model reference (see the module doc) -> a local HF-layout dir holding config.json.

    `cache_dir` and `seed` only matter for built-ins. Raises CheckpointError naming the reference.
    """
    if model.startswith(BUILTIN_PREFIX):
        return builtin_dir(model, cache_dir, seed)
    path = Path(model).expanduser()
    if path.is_dir():
        return _check_layout(path, model)
    ref = parse_hub_ref(model)
    if ref is None:
        raise CheckpointError(
            f"model {model!r}: no such directory, and not a Hugging Face repo id (org/name[@revision]); "
            "give an HF-layout directory, a repo id or builtin:tiny"
        )
    return _check_layout(snapshot(ref), str(ref))


def resolve_tokenizer(
    tokenizer: str | None, model_dir: Path, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """spec.model.tokenizer (same forms as the checkpoint) -> its dir; the checkpoint's own when None."""
    if tokenizer is None:
        return model_dir
    if tokenizer.startswith(BUILTIN_PREFIX):
        return builtin_dir(tokenizer, cache_dir)
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        return path
    ref = parse_hub_ref(tokenizer)
    if ref is None:
        raise CheckpointError(
            f"spec.model.tokenizer {tokenizer!r}: no such directory, and not a Hugging Face repo id"
        )
    return snapshot(ref)


def snapshot(
    ref: HubRef,
    dest: str | os.PathLike[str] | None = None,
    *,
    repo_type: str = "model",
    allow_patterns: tuple[str, ...] = ALLOW_PATTERNS,
) -> Path:
    """Fetch (or, offline, look up) the snapshot of `ref`; into `dest` when given, else the hub cache.

    Offline with `dest`, the cached snapshot is copied there (a half-filled `dest` is never taken for
    the model). `repo_type` "dataset" fetches a dataset repo (lockstep.models.hub_data). Raises
    CheckpointError naming the repo, the cache and the fix; never the token.
    """
    from huggingface_hub import snapshot_download

    if dest is not None and offline():
        cached = snapshot(ref, repo_type=repo_type, allow_patterns=allow_patterns)
        shutil.copytree(cached, dest, dirs_exist_ok=True)  # follows the cache's symlinks to blobs
        return Path(dest)
    cache = hub_cache_dir()
    token = os.environ.get("HF_TOKEN") or None
    try:
        path = snapshot_download(
            ref.repo_id,
            revision=ref.revision,
            cache_dir=str(cache),
            local_dir=str(dest) if dest is not None else None,
            repo_type=repo_type,
            allow_patterns=list(allow_patterns),
            local_files_only=offline(),
            token=token,
            endpoint=os.environ.get("HF_ENDPOINT") or None,  # read now, not at huggingface_hub's import
        )
    except Exception as e:  # the hub's errors (not found, gated, offline miss) and network errors
        raise CheckpointError(_hub_error(ref, cache, e, token, repo_type)) from None
    return Path(path)


def _hub_error(ref: HubRef, cache: Path, e: Exception, token: str | None, repo_type: str = "model") -> str:
    what = str(e).splitlines()[0] if str(e) else type(e).__name__
    if token:
        what = what.replace(token, "***")
    if offline():
        pull = "--dataset " if repo_type == "dataset" else ""
        field = "spec.data.prompts" if repo_type == "dataset" else "spec.model.checkpoint"
        return (
            f"{repo_type} {ref}: not in the Hugging Face cache {cache} and HF_HUB_OFFLINE=1 forbids a download "
            f"({type(e).__name__}); run `lockstep pull-model {pull}{ref} --dest DIR` where the hub is reachable "
            f"and point {field} at DIR, or fill the cache (HF_HOME)"
        )
    return (
        f"{repo_type} {ref}: cannot fetch it from the Hugging Face hub into {cache}: {type(e).__name__}: {what}; "
        "check the repo id and revision, HF_ENDPOINT, and for a gated or private repo the token (HF_TOKEN)"
    )


def _check_layout(path: Path, ref: str) -> Path:
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"model {ref!r}: {path} has no config.json; give a directory in Hugging Face layout "
            "(config.json, *.safetensors, tokenizer.json, tokenizer_config.json)"
        )
    return path


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSource:
    """Where a run's model comes from (spec.model: checkpoint, tokenizer, chatTemplate); resolved to a
    local directory at start, with the same tokenizer on every side of the run."""

    checkpoint: str
    """A model reference: a directory, a hub repo id, or `builtin:<name>`."""
    tokenizer: str | None = None
    """Another checkpoint's tokenizer (a reference like `checkpoint`); None: the checkpoint's own."""
    chat_template: str | None = None
    """A Jinja chat template replacing the tokenizer's; None keeps it."""

    def resolve(self, cache_dir: str | os.PathLike[str] | None = None, seed: int = 0) -> Path:
        """The checkpoint as a local HF-layout directory (resolve_checkpoint)."""
        return resolve_checkpoint(self.checkpoint, cache_dir=cache_dir, seed=seed)

    def load_tokenizer(
        self, model_dir: Path, cache_dir: str | os.PathLike[str] | None = None
    ) -> ChatTokenizer:
        """The run's tokenizer for the resolved checkpoint `model_dir` (load_tokenizer)."""
        return load_tokenizer(model_dir, self.tokenizer, self.chat_template, cache_dir)


def load_tokenizer(
    model_dir: Path,
    tokenizer: str | None = None,
    chat_template: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> ChatTokenizer:
    """The run's tokenizer: spec.model.tokenizer's (else the checkpoint's), with spec.model.chatTemplate
    replacing its template when set."""
    return ChatTokenizer.load(resolve_tokenizer(tokenizer, model_dir, cache_dir), chat_template)


def copy_model_files(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> list[str]:
    """Copy the checkpoint's non-weight files (tokenizer, chat template, generation config) from `src`
    into the saved checkpoint `dst`, so `dst` loads alone in transformers; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        path = Path(src) / name
        if path.is_file() and not (Path(dst) / name).exists():
            shutil.copyfile(path, Path(dst) / name)
            copied.append(name)
    return copied
