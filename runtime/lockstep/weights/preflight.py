"""Pre-flight `check-weight-update-equal`: prove the engines hold exactly the trainer's weights (seed §7.2.5).

Why it exists: a transport that silently drops a tensor trains against the wrong policy. The check runs
on SGLang's own POST /weights_checker (CheckWeightsReqInput), as Miles' --check-weight-update-equal
does, so it runs unchanged against stock SGLang and the reference engine: `snapshot` (each engine
copies the weights it loaded, the trainer's starting checkpoint), `reset_tensors` (noise in every
weight), the real first update through the chosen transport, then `compare` (every weight against
the snapshot; a tensor the transport missed still holds noise) and `checksum` (every engine must
report the same digest; with `trainer_checksums`, each tensor's hash must equal the trainer's
export's, for engines that name tensors as HF does and hash on the CPU, i.e. the reference engine).
Checksums alone have passed while a post-load step (a weight shuffle) was skipped, so a logprob probe
follows: greedy generation on a fixed prompt, the engine's logprobs against the trainer's forward.

The result is a pydantic model (it travels in the driver's progress report) and becomes the
WeightChannel's PreflightPassed condition, naming the differing tensors.

Who calls it: the trainer's first update when check_weight_update_equal is set (lockstep.trainer);
tests; the operator reads the result through the driver's progress report.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from lockstep.api.common import Condition, ConditionStatus
from lockstep.serving.client import EngineClient
from lockstep.serving.loop import LoopThread
from lockstep.serving.payloads import CheckAction, CheckWeightsReply, SamplingParams
from lockstep.weights import st_bytes as sb
from lockstep.weights.transport import WeightTransport

if TYPE_CHECKING:
    import torch


def tensor_hash(tensor: torch.Tensor) -> str:
    """SGLang's tensor_hash on the CPU (sglang.srt.managers.mm_utils), as /weights_checker prints it:
    the first 8 bytes of sha256 over the tensor's row-major bytes, as 16 hex digits."""
    return hashlib.sha256(sb.tensor_bytes(tensor).tobytes()).hexdigest()[:16]


class TensorMismatch(BaseModel):
    """One tensor whose engine copy differs from the trainer's."""

    model_config = ConfigDict(extra="forbid")
    engine: str
    """URL of the engine."""
    name: str
    """HF name."""
    reason: Literal["differs", "missing", "checksum", "replica"]
    """`differs`: /weights_checker compare found it unequal to the loaded checkpoint (still noise);
    `missing`: the engine has no tensor of that name; `checksum`: its hash differs from the trainer's;
    `replica`: its hash differs from the first engine's."""
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
    engine: str, expected: dict[str, str], got: dict[str, str], *, against: str = "trainer"
) -> list[TensorMismatch]:
    """Tensors whose checksum on `engine` differs from `expected` (the trainer's, or another engine's)."""
    reason: Literal["checksum", "replica"] = "checksum" if against == "trainer" else "replica"
    out = []
    for name, want in expected.items():
        have = got.get(name)
        if have is None:
            out.append(TensorMismatch(engine=engine, name=name, reason="missing"))
        elif have != want:
            detail = f"{against} {want}, engine {have}"
            out.append(TensorMismatch(engine=engine, name=name, reason=reason, detail=detail))
    return out


def compare_failures(engine: str, message: str) -> list[TensorMismatch]:
    """The tensors a failed /weights_checker compare names: one `name=<tensor> ...` line each."""
    out = []
    for line in message.splitlines():
        if line.startswith("name="):
            name, _, detail = line.removeprefix("name=").partition(" ")
            out.append(TensorMismatch(engine=engine, name=name, reason="differs", detail=detail[:500]))
    return out


def rank_checksums(reply: CheckWeightsReply) -> dict[str, str]:
    """name -> checksum over an engine's ranks (one rank per name unless TP splits it: the first wins)."""
    out: dict[str, str] = {}
    for rank in reply.ranks or []:
        for name, value in rank.checksums.items():
            out.setdefault(name, value)
    return out


async def _probe(client: EngineClient, probe: LogprobProbe) -> float:
    params = SamplingParams(max_new_tokens=probe.max_new_tokens, temperature=0.0)
    result = await client.generate(probe.prompt_ids, params)
    tokens, engine_lp = list(result.output_ids), list(result.output_logprobs)
    trainer_lp = probe.trainer_logprobs(list(probe.prompt_ids), tokens)
    if len(trainer_lp) != len(engine_lp):
        raise ValueError(f"trainer returned {len(trainer_lp)} logprobs for {len(engine_lp)} generated tokens")
    return max((abs(a - b) for a, b in zip(engine_lp, trainer_lp, strict=True)), default=0.0)


class PreflightError(RuntimeError):
    """An engine could not run a /weights_checker action; the message names the engine and the action."""


def _run(
    io: LoopThread, client: EngineClient, action: CheckAction, skip: Sequence[str] | None
) -> CheckWeightsReply:
    reply = io.run(client.check_weights(action, skip_tensor_list=skip))
    if not reply.success and action != "compare":
        raise PreflightError(f"{client.base_url}/weights_checker action {action!r} failed: {reply.message}")
    return reply


def check_weight_update_equal(
    engine_urls: list[str],
    transport: WeightTransport,
    named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    *,
    version: int = 0,
    probe: LogprobProbe | None = None,
    trainer_checksums: bool = False,
    compare_loaded: bool = True,
    skip_tensor_list: Sequence[str] | None = None,
    served: Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[tuple[str, torch.Tensor]]] | None = None,
) -> PreflightResult:
    """Snapshot and reset every engine, run the first update through `transport`, compare, probe.

    `named_tensors` is called once for the update and, with `trainer_checksums`, once more for the
    trainer's hashes, so it must yield the same export both times (the trainer's export_weights,
    before any step). `compare_loaded`: the trainer exports the checkpoint the engines loaded (a fresh
    job: no SFT warm start, no resume), so each engine's `compare` against its snapshot decides; when
    False only the checksums and the probe do. An engine that cannot run an action fails the result.
    `served` maps the export to what the engines must hold when a stage dequantizes (low-precision
    serving: allow the quantization error, but only the shared quantizer's own, bit for bit).
    """
    io = LoopThread("preflight-io")
    clients = [EngineClient(u) for u in engine_urls]
    try:
        try:
            for c in clients:
                if compare_loaded:
                    _run(io, c, "snapshot", skip_tensor_list)
                _run(io, c, "reset_tensors", skip_tensor_list)
            transport.update_weights(named_tensors(), version)
            mismatches: list[TensorMismatch] = []
            for c in clients if compare_loaded else ():
                reply = _run(io, c, "compare", skip_tensor_list)
                if not reply.success:
                    mismatches += compare_failures(c.base_url, reply.message) or [
                        TensorMismatch(
                            engine=c.base_url, name="(unnamed)", reason="differs", detail=reply.message[:500]
                        )
                    ]
            sums = {c.base_url: rank_checksums(_run(io, c, "checksum", skip_tensor_list)) for c in clients}
        except PreflightError as e:
            return PreflightResult(passed=False, engines=len(clients), checked_tensors=0, message=str(e))
        first_url, first = next(iter(sums.items()))
        for url, got in list(sums.items())[1:]:
            mismatches += compare(url, first, got, against=first_url)
        checked = len(first)
        if trainer_checksums:
            expected = {n: tensor_hash(t) for n, t in (served or iter)(named_tensors())}
            checked = len(expected)
            for url, got in sums.items():
                mismatches += compare(url, expected, got)
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
            message = f"{checked} tensors equal on {len(clients)} engines" + (
                "" if worst is None else f"; logprob probe max diff {worst:.2e}"
            )
        return PreflightResult(
            passed=passed,
            engines=len(clients),
            checked_tensors=checked,
            mismatches=mismatches,
            logprob_max_abs_diff=worst,
            logprob_tolerance=None if probe is None else probe.tolerance,
            message=message,
        )
    finally:
        for c in clients:
            io.run(c.aclose())
        io.close()
