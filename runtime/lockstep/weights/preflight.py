"""Pre-flight `check-weight-update-equal`: prove the engines hold exactly the trainer's weights (seed §7.2.5).

Why it exists: a transport that silently drops a tensor trains against the wrong policy. Before the
first update the check overwrites every engine tensor with random data (our engine extension
`POST /lockstep/weights/randomize`, lockstep.engine.ext_weights), runs the real first update through
the chosen transport, then compares every expected tensor by name, dtype, shape and xxh3-128 checksum
(`POST /lockstep/weights/checksums`). A tensor the transport missed still holds noise and cannot match
by accident. Checksums alone have passed while a post-load step (a weight shuffle) was skipped, so a
logprob probe follows: greedy generation on a fixed prompt, the engine's logprobs against the trainer's
forward on the same tokens.

The result is a pydantic model (it travels in the driver's progress report) and becomes the
WeightChannel's PreflightPassed condition, naming the differing tensors.

Who calls it: the driver before the first optimizer step when check_weight_update_equal is set;
tests; the operator reads the result through the driver's progress report.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from lockstep.api.common import Condition, ConditionStatus
from lockstep.serving.client import EngineClient
from lockstep.serving.loop import LoopThread
from lockstep.serving.payloads import SamplingParams
from lockstep.weights import st_bytes as sb
from lockstep.weights.transport import WeightTransport

if TYPE_CHECKING:
    import torch

RANDOMIZE_PATH = "/lockstep/weights/randomize"
CHECKSUMS_PATH = "/lockstep/weights/checksums"


class RandomizeRequest(BaseModel):
    """POST /lockstep/weights/randomize body (our extension, not in SGLang)."""

    model_config = ConfigDict(extra="forbid")
    seed: int = 0
    """Seed of the noise; every tensor of the engine is overwritten."""


class TensorSummary(BaseModel):
    """Layout and checksum of one tensor, as the engine or the trainer holds it."""

    model_config = ConfigDict(extra="forbid")
    dtype: str
    """torch dtype without the prefix, e.g. bfloat16."""
    shape: list[int]
    """Shape."""
    checksum: str
    """xxh3-128 of the tensor's bytes."""


class ChecksumsRequest(BaseModel):
    """POST /lockstep/weights/checksums body (our extension)."""

    model_config = ConfigDict(extra="forbid")
    names: list[str] | None = None
    """Tensors to summarize; None means every tensor of the engine."""


class ChecksumsReply(BaseModel):
    """Reply of /lockstep/weights/checksums."""

    model_config = ConfigDict(extra="forbid")
    tensors: dict[str, TensorSummary]
    """HF name -> summary."""
    weight_version: str | None = None
    """The engine's weight version when summarized."""


def summarize(tensor: torch.Tensor) -> TensorSummary:
    return TensorSummary(
        dtype=str(tensor.dtype).removeprefix("torch."),
        shape=list(tensor.shape),
        checksum=sb.checksum(sb.tensor_bytes(tensor)),
    )


class TensorMismatch(BaseModel):
    """One tensor whose engine copy differs from the trainer's."""

    model_config = ConfigDict(extra="forbid")
    engine: str
    """URL of the engine."""
    name: str
    """HF name."""
    reason: Literal["missing", "checksum", "layout"]
    """missing on the engine, different bytes (e.g. still noise), or different dtype/shape."""
    detail: str = ""
    """Trainer vs engine values."""


class PreflightResult(BaseModel):
    """Outcome of the pre-flight check; serialized into the driver's progress report."""

    model_config = ConfigDict(extra="forbid")
    passed: bool
    """True when every tensor matched on every engine and the logprob probe stayed within tolerance."""
    engines: int
    """Engines checked."""
    checked_tensors: int
    """Trainer tensors compared on each engine."""
    mismatches: list[TensorMismatch] = Field(default_factory=list)
    """Every differing tensor (the condition message names the first ones)."""
    logprob_max_abs_diff: float | None = None
    """max |engine logprob - trainer logprob| over the probe's tokens; None when no probe ran."""
    logprob_tolerance: float | None = None
    """The probe's bound."""
    message: str = ""
    """One-line human summary."""

    def condition(self, now: dt.datetime, observed_generation: int | None = None) -> Condition:
        """The WeightChannel/RLJob PreflightPassed condition for this result."""
        if self.passed:
            reason = "WeightsEqual"
        elif self.mismatches:
            reason = "TensorsDiffer"
        else:
            reason = "LogprobProbeFailed"
        return Condition(
            type="PreflightPassed",
            status=ConditionStatus.TRUE if self.passed else ConditionStatus.FALSE,
            reason=reason,
            message=self.message[:32768],
            last_transition_time=now,
            observed_generation=observed_generation,
        )


TrainerLogprobs = Callable[[list[int], list[int]], list[float]]
"""(prompt ids, response ids) -> the trainer's logprob of each response token (greedy: log_softmax)."""


@dataclass(slots=True)
class LogprobProbe:
    """The fixed-prompt logprob comparison that catches a skipped post-load step."""

    prompt_ids: list[int]
    """The fixed prompt."""
    trainer_logprobs: TrainerLogprobs
    """The trainer's forward on the same tokens."""
    max_new_tokens: int = 8
    """Greedy tokens to generate and compare."""
    tolerance: float = 0.05
    """Largest accepted |engine - trainer| logprob difference (bf16 kernels differ a little)."""


def compare(
    engine: str, expected: dict[str, TensorSummary], got: dict[str, TensorSummary]
) -> list[TensorMismatch]:
    """Mismatches of one engine's summaries against the trainer's (pure)."""
    out = []
    for name, want in expected.items():
        have = got.get(name)
        if have is None:
            out.append(TensorMismatch(engine=engine, name=name, reason="missing"))
        elif (have.dtype, have.shape) != (want.dtype, want.shape):
            detail = f"trainer {want.dtype}{want.shape}, engine {have.dtype}{have.shape}"
            out.append(TensorMismatch(engine=engine, name=name, reason="layout", detail=detail))
        elif have.checksum != want.checksum:
            detail = f"trainer {want.checksum}, engine {have.checksum}"
            out.append(TensorMismatch(engine=engine, name=name, reason="checksum", detail=detail))
    return out


async def _probe(client: EngineClient, probe: LogprobProbe) -> float:
    params = SamplingParams(max_new_tokens=probe.max_new_tokens, temperature=0.0)
    result = await client.generate(probe.prompt_ids, params)
    tokens, engine_lp = list(result.output_ids), list(result.output_logprobs)
    trainer_lp = probe.trainer_logprobs(list(probe.prompt_ids), tokens)
    if len(trainer_lp) != len(engine_lp):
        raise ValueError(f"trainer returned {len(trainer_lp)} logprobs for {len(engine_lp)} generated tokens")
    return max((abs(a - b) for a, b in zip(engine_lp, trainer_lp, strict=True)), default=0.0)


def check_weight_update_equal(
    engine_urls: list[str],
    transport: WeightTransport,
    named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    *,
    version: int = 0,
    probe: LogprobProbe | None = None,
    seed: int = 0,
    served: Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[tuple[str, torch.Tensor]]] | None = None,
) -> PreflightResult:
    """Randomize every engine, run the first update through `transport`, compare, probe.

    `named_tensors` is called twice (once for the update, once for the trainer's checksums), so it
    must yield the same export both times (the trainer's export_weights, before any step).
    `served` maps the export to what the engines must hold when a stage dequantizes (low-precision
    serving: allow the quantization error, but only the shared quantizer's own, bit for bit).
    """
    io = LoopThread("preflight-io")
    clients = [EngineClient(u) for u in engine_urls]
    try:
        for c in clients:
            io.run(c.post_json(RANDOMIZE_PATH, RandomizeRequest(seed=seed)))
        transport.update_weights(named_tensors(), version)
        expected = {n: summarize(t) for n, t in (served or iter)(named_tensors())}
        mismatches: list[TensorMismatch] = []
        for c in clients:
            reply = ChecksumsReply.model_validate(
                io.run(c.post_json(CHECKSUMS_PATH, ChecksumsRequest(names=list(expected))))
            )
            mismatches += compare(c.base_url, expected, reply.tensors)
        worst = None
        if probe is not None and not mismatches:
            worst = max(io.run(_probe(c, probe)) for c in clients)
        probe_ok = worst is None or worst <= (probe.tolerance if probe else 0.0)
        passed = not mismatches and probe_ok
        if mismatches:
            names = sorted({m.name for m in mismatches})
            message = f"{len(names)} tensors differ after the first update: " + ", ".join(names[:20])
        elif not probe_ok:
            assert probe is not None
            message = f"checksums match but the logprob probe differs by {worst:.4f} > {probe.tolerance} (a post-load step skipped?)"
        else:
            message = f"{len(expected)} tensors equal on {len(clients)} engines" + (
                "" if worst is None else f"; logprob probe max diff {worst:.2e}"
            )
        return PreflightResult(
            passed=passed,
            engines=len(clients),
            checked_tensors=len(expected),
            mismatches=mismatches,
            logprob_max_abs_diff=worst,
            logprob_tolerance=None if probe is None else probe.tolerance,
            message=message,
        )
    finally:
        for c in clients:
            io.run(c.aclose())
        io.close()
