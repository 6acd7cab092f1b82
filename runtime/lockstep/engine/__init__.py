"""The reference rollout engine: SGLang's HTTP API subset on torch, for CPU and CUDA.

Why it exists: Lockstep runs a whole RL job on one machine without SGLang, and tests every runtime
path against a real engine on 127.0.0.1. The engine batches concurrent /generate requests
continuously over a slotted KV cache, reuses cached prefixes, returns per-token logprobs and
weight versions, pauses (abort | retract | in_place) and takes weight updates from disk, from a
broadcast group, or from serialized tensors.

Stable in-process API (the weights helper and lockstep.engine.ext_weights rely on it):
- `ReferenceEngine.load(dir, device="cpu"|"cuda", ...)`; `await engine.start()`; `await engine.close()`.
- `engine.device` (torch.device); `engine.weight_version` (int) and `engine.set_weight_version(v)`.
- `engine.named_weights() -> dict[str, torch.Tensor]`: HF names -> live tensors.
- `engine.load_weights(named: Iterable[tuple[str, Tensor]]) -> int`: copies into the live params;
  raises KeyError on an unknown name, ValueError on a shape or dtype mismatch; returns the count.
- `async with engine.paused(mode="retract"):` no step runs inside; prefix cache flushed on exit.
- `async with engine.exclusive():` hold the step lock without pausing (for short updates).
- `await engine.run_in_worker(fn, *args)`: run tensor work on the engine's thread.
- `create_app(engine, *, allow_tensor_updates=False) -> aiohttp.web.Application`; handlers find the
  engine at `app[ENGINE_KEY]`. If `lockstep.engine.ext_weights` exists, `create_app` calls its
  `register(app, engine)`.

Served by `lockstep engine --model DIR|builtin:tiny --host 127.0.0.1 --port N [--device cpu|cuda]`.
"""

from __future__ import annotations

from lockstep.engine.core import EngineInputError, EngineStats, ReferenceEngine
from lockstep.engine.server import ENGINE_KEY, create_app

__all__ = ["ENGINE_KEY", "EngineInputError", "EngineStats", "ReferenceEngine", "create_app"]
