"""The SGLang HTTP contract: payload models, the async EngineClient, and the weight-update helpers.

Why it exists: everything that talks to a rollout engine (real SGLang or `lockstep engine`) goes
through this package, so payload shapes live in one place and are pinned by contract tests.

Public API:
- payloads: SamplingParams, GenerateRequest, GenerateReply, ... and ROUTES (endpoint -> method, path).
- EngineClient (async; retries, then EngineUnreachable), GenerateResult, GenerateBackend (Protocol),
  EngineError, NoReply (the connection broke after the request was sent), ContextFull (the input fills
  the engine's context: no room for a completion).
- open_weight_update_group / WeightUpdateGroup: the group of /init_weights_update_group (both ends).
- dumps_named_tensors / loads_named_tensors: the /update_weights_from_tensor format (restricted loader).

Who calls it: lockstep.rollout, lockstep.weights, lockstep.driver, lockstep.engine.
"""

from __future__ import annotations

from lockstep.serving.client import (
    EngineClient,
    EngineError,
    EngineUnreachable,
    GenerateBackend,
    GenerateResult,
    result_from_reply,
)
from lockstep.serving.context_fit import ContextFull
from lockstep.serving.http import NoReply
from lockstep.serving.payloads import (
    ROUTES,
    FinishReason,
    GenerateReply,
    GenerateRequest,
    MetaInfo,
    SamplingParams,
)
from lockstep.serving.tensor_codec import UnsafePayload, dumps_named_tensors, loads_named_tensors
from lockstep.serving.weight_group import WeightUpdateGroup, open_weight_update_group

__all__ = [
    "ROUTES",
    "ContextFull",
    "EngineClient",
    "EngineError",
    "EngineUnreachable",
    "FinishReason",
    "GenerateBackend",
    "GenerateReply",
    "GenerateRequest",
    "GenerateResult",
    "MetaInfo",
    "NoReply",
    "SamplingParams",
    "UnsafePayload",
    "WeightUpdateGroup",
    "dumps_named_tensors",
    "loads_named_tensors",
    "open_weight_update_group",
    "result_from_reply",
]
