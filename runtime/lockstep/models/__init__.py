"""Models: where a checkpoint comes from, its tokenizer and chat template, and the model families.

Why it exists: the rollout engine, the trainer and the session server must agree on token IDs and on
how a conversation becomes tokens. A checkpoint is always a directory in Hugging Face layout (resolved
from a path, a hub repo id or `builtin:<name>` by lockstep.models.checkpoint); its own tokenizer and
chat template are read by lockstep.models.tokenizer. The family modules (lockstep.models.families)
say only what a template cannot: the TITO seam and tool-call parsing. `builtin:tiny` is the offline
checkpoint of `lockstep run` on one machine and of the tests (nothing is ever downloaded there).

Who calls it: lockstep.engine (loads checkpoints, decodes text), lockstep.train (loads the same
checkpoint), lockstep.rollout (renders chats), lockstep.driver, the CLI.
"""

from __future__ import annotations

from lockstep.models.checkpoint import (
    CheckpointError,
    ModelSource,
    load_tokenizer,
    resolve_checkpoint,
    resolve_tokenizer,
)
from lockstep.models.tiny import (
    BUILTIN_PREFIX,
    BUILTIN_SPECS,
    bigger_config,
    is_builtin,
    materialize_builtin,
    tiny_config,
)
from lockstep.models.tokenizer import ChatTokenizer

__all__ = [
    "BUILTIN_PREFIX",
    "BUILTIN_SPECS",
    "ChatTokenizer",
    "CheckpointError",
    "ModelSource",
    "bigger_config",
    "is_builtin",
    "load_tokenizer",
    "materialize_builtin",
    "resolve_checkpoint",
    "resolve_tokenizer",
    "tiny_config",
]
