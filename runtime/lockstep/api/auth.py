"""The job's shared API key as every process reads and sends it (a cross-process contract).

Why it exists: the operator creates one random key per job (Secret `<job>-api-key`) and mounts it in
every pod as LOCKSTEP_API_KEY; the engines (SGLang's --api-key), the session server and the trainer
command server require it as `Authorization: Bearer <key>`, and every client sends it. The name and
the header live here, in the lowest layer, so the operator, the servers and the agents agree.

Who calls it: lockstep.serving (clients, server guard), lockstep.tasks agents, lockstep.driver,
lockstep_operator.resources.
"""

from __future__ import annotations

import os

API_KEY_ENV = "LOCKSTEP_API_KEY"
"""The env var holding the job's key (from Secret `<job>-api-key`, item `api-key`)."""


def api_key_from_env() -> str | None:
    """The job's key from LOCKSTEP_API_KEY, or None when unset or empty."""
    return os.environ.get(API_KEY_ENV) or None


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """`Authorization: Bearer <key>` (key defaults to LOCKSTEP_API_KEY); {} when there is no key.
    Never log the result."""
    key = api_key if api_key is not None else api_key_from_env()
    return {"Authorization": f"Bearer {key}"} if key else {}
