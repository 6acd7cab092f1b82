"""The registered model families, one module each (qwen3, glm47, glm5, tiny), and the lookup by name.

Why it exists: importing this package registers every built-in family with lockstep.models.registry,
so `get_family("qwen3")` works without the caller knowing module paths. The lookup lives here, above
the families, so the registry never imports them back.

Who calls it: lockstep.rollout.session (the session server), lockstep.cli.sessions, tests.
"""

from __future__ import annotations

from lockstep.models.families import glm5, glm47, qwen3, tiny
from lockstep.models.registry import FACTORIES, ModelFamily

__all__ = ["get_family", "glm5", "glm47", "names", "qwen3", "tiny"]

_CACHE: dict[tuple[str, str | None], ModelFamily] = {}


def names() -> list[str]:
    """Registered family names, sorted."""
    return sorted(FACTORIES)


def get_family(name: str, tokenizer_dir: str | None = None) -> ModelFamily:
    """The family registered as `name` (built once per tokenizer and cached).

    `tokenizer_dir`: the served model's checkpoint dir; its tokenizer is used so that the session
    server's IDs are the engine's. None uses the family's offline stand-in (tests, benchmarks).
    """
    key = name.removeprefix("builtin:")
    if key not in FACTORIES:
        raise KeyError(f"unknown model family {name!r}; registered families: {', '.join(sorted(FACTORIES))}")
    cache_key = (key, tokenizer_dir)
    if cache_key not in _CACHE:
        _CACHE[cache_key] = FACTORIES[key](tokenizer_dir)
    return _CACHE[cache_key]
