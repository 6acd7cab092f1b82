"""The registered model families, one module each: qwen3, glm47 and tiny.

Why it exists: importing this package registers every built-in family with
lockstep.models.registry, so `get_family("qwen3")` works without the caller knowing module paths.

Who calls it: lockstep.models.registry (lazily, on first lookup).
"""

from __future__ import annotations

from lockstep.models.families import glm47, qwen3, tiny

__all__ = ["glm47", "qwen3", "tiny"]
