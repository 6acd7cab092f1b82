"""The operator's reader of the progress channel; the contract itself lives in lockstep.api.progress.

Why it exists: the driver (runtime) and the operator must agree on one document, and the runtime may
not import the operator, so `ProgressReport` and `PROGRESS_KEY` are defined in lockstep.api.progress
and re-exported here. What stays here is the operator's side: `read_progress`, which turns the
ConfigMap `<job>-progress` into a report or a human-readable problem for a status condition.

Who calls it: the reconciles (rljob, rolloutpool, weightchannel); the driver writes the document
through lockstep.progress, the e2e tests may also write it with
`kubectl patch configmap <job>-progress -p '{"data":{"progress.json":"{\"step\":3,...}"}}'`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from lockstep.api.progress import PROGRESS_KEY, RANK_KEY_PREFIX, ProgressReport
from pydantic import ValidationError

__all__ = ["PROGRESS_KEY", "ProgressReport", "read_progress", "read_rank_reports"]


def read_progress(config_map: Mapping[str, Any] | None) -> tuple[ProgressReport | None, str | None]:
    """Parse the progress ConfigMap; (report, None), (None, None) when empty, (None, problem) when bad."""
    if not config_map:
        return None, None
    raw = (config_map.get("data") or {}).get(PROGRESS_KEY)
    if not raw:
        return None, None
    try:
        return ProgressReport.model_validate(json.loads(raw)), None
    except ValidationError as err:
        where = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()[:5])
        return None, f"{PROGRESS_KEY} in the progress ConfigMap is not a valid report: {where}"
    except ValueError as err:
        return None, f"{PROGRESS_KEY} in the progress ConfigMap is not JSON: {err}"


def read_rank_reports(config_map: Mapping[str, Any] | None) -> dict[int, ProgressReport]:
    """Trainer rank -> its document (`rank-<r>.json`, written when the rank cannot start); a key or
    document that does not parse is left out (the rank's pod failure still counts)."""
    out: dict[int, ProgressReport] = {}
    for key, raw in ((config_map or {}).get("data") or {}).items():
        number = key.removeprefix(RANK_KEY_PREFIX).removesuffix(".json")
        if not key.startswith(RANK_KEY_PREFIX) or not number.isdigit():
            continue
        try:
            out[int(number)] = ProgressReport.model_validate(json.loads(raw))
        except ValueError:  # ValidationError is a ValueError, as is bad JSON
            continue
    return out
