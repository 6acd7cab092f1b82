"""Model families the runtime knows: tokenizer, chat format and offline checkpoints.

Why it exists: the rollout engine, the trainer and the session server must agree on token IDs and on
how a conversation becomes tokens. Each family lives in its own module; `tiny` is the offline family
used by `lockstep run` on one machine and by the tests (nothing is ever downloaded).

Who calls it: lockstep.engine (loads checkpoints, decodes text), lockstep.train (loads the same
checkpoint), lockstep.rollout (renders chats), lockstep.tasks (writes prompts).
"""

from __future__ import annotations

from lockstep.models.tiny import (
    BUILTIN_PREFIX,
    BUILTIN_SPECS,
    TinyTokenizer,
    bigger_config,
    is_builtin,
    materialize_builtin,
    resolve_checkpoint,
    tiny_config,
)

__all__ = [
    "BUILTIN_PREFIX",
    "BUILTIN_SPECS",
    "TinyTokenizer",
    "bigger_config",
    "is_builtin",
    "materialize_builtin",
    "resolve_checkpoint",
    "tiny_config",
]
