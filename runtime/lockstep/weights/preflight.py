"""Pre-flight `check-weight-update-equal`: prove the engines hold exactly the trainer's weights (§7.2.5).

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
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from lockstep.api.common import Condition, ConditionStatus
from lockstep.models import st_bytes as sb
from lockstep.serving.client import EngineClient
from lockstep.serving.loop import LoopThread
from lockstep.serving.payloads import CheckAction, CheckWeightsReply, SamplingParams
from lockstep.weights.fallback import Export
from lockstep.weights.transport import TransferReport, WeightTransport

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


PREFLIGHT_FILE = "preflight.json"
"""Where in the run dir the pre-flight's PreflightResult (pydantic JSON) is written, passed or not."""


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
    lora_path: str | None = None
    """The LoRA adapter the engine samples the probe with (a LoRA job's pre-flight); None: the base."""


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


def replica_mismatches(sums: dict[str, dict[str, str]]) -> list[TensorMismatch]:
    """Tensors whose checksum on an engine differs from the first engine's (engine url -> name -> checksum)."""
    first_url, first = next(iter(sums.items()))
    return [m for url, got in list(sums.items())[1:] for m in compare(url, first, got, against=first_url)]


def probe_engines(
    io: LoopThread, clients: Sequence[EngineClient], probe: LogprobProbe | None
) -> float | None:
    """The largest |engine - trainer| logprob of the probe over the engines; None without a probe."""
    return None if probe is None else max(io.run(_probe(c, probe)) for c in clients)


def probe_ok(worst: float | None, probe: LogprobProbe | None) -> bool:
    """Whether the probe ran within its tolerance (true when no probe ran)."""
    return worst is None or probe is None or worst <= probe.tolerance


def checked_result(
    *,
    engines: int,
    checked: int,
    mismatches: list[TensorMismatch],
    worst: float | None,
    probe: LogprobProbe | None,
    message: str,
) -> PreflightResult:
    """The result of a pre-flight that ran: passed when no tensor differs and the probe is within bounds."""
    return PreflightResult(
        passed=not mismatches and probe_ok(worst, probe),
        engines=engines,
        checked_tensors=checked,
        mismatches=mismatches,
        logprob_max_abs_diff=worst,
        logprob_tolerance=None if probe is None else probe.tolerance,
        message=message,
    )


@contextmanager
def engine_clients(
    engine_urls: Sequence[str], thread: str
) -> Iterator[tuple[LoopThread, list[EngineClient]]]:
    """A loop thread named `thread` and a client per engine, closed on exit."""
    io = LoopThread(thread)
    clients = [EngineClient(u) for u in engine_urls]
    try:
        yield io, clients
    finally:
        for c in clients:
            io.run(c.aclose())
        io.close()


async def _probe(client: EngineClient, probe: LogprobProbe) -> float:
    params = SamplingParams(max_new_tokens=probe.max_new_tokens, temperature=0.0)
    result = await client.generate(probe.prompt_ids, params, lora_path=probe.lora_path)
    tokens, engine_lp = list(result.output_ids), list(result.output_logprobs)
    trainer_lp = probe.trainer_logprobs(list(probe.prompt_ids), tokens)
    if len(trainer_lp) != len(engine_lp):
        raise ValueError(f"trainer returned {len(trainer_lp)} logprobs for {len(engine_lp)} generated tokens")
    return max((abs(a - b) for a, b in zip(engine_lp, trainer_lp, strict=True)), default=0.0)


class PreflightError(RuntimeError):
    """An engine could not run a /weights_checker action; the message names the engine and the action."""


def run_check(
    io: LoopThread,
    client: EngineClient,
    action: CheckAction,
    skip: Sequence[str] | None = None,
    quant: bool = False,
) -> CheckWeightsReply:
    """One /weights_checker action on one engine; a failed action other than `compare` raises PreflightError."""
    reply = io.run(client.check_weights(action, skip_tensor_list=skip, allow_quant_error=quant))
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
    allow_quant_error: bool = False,
    skip_tensor_list: Sequence[str] | None = None,
    served: Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[tuple[str, torch.Tensor]]] | None = None,
    on_report: Callable[[TransferReport], None] | None = None,
) -> PreflightResult:
    """Snapshot and reset every engine, run the first update through `transport`, compare, probe.

    `named_tensors` is called once for the update and, with `trainer_checksums`, once more for the
    trainer's hashes, so it must yield the same export both times (the trainer's export_weights,
    before any step). `compare_loaded`: the trainer exports the checkpoint the engines loaded (a fresh
    job: no SFT warm start, no resume), so each engine's `compare` against its snapshot decides; when
    False only the checksums and the probe do. `allow_quant_error`: SGLang engines serving quantized
    weights (FP8, MXFP8, NVFP4) may differ from the snapshot within one quantization step. An engine that
    cannot run an action fails the result. `served` maps the export to what the engines must hold when a
    stage dequantizes (low-precision serving: allow the quantization error, but only the shared
    quantizer's own, bit for bit). `on_report` receives the update's TransferReport (its phases).
    """
    with engine_clients(engine_urls, "preflight-io") as (io, clients):
        try:
            for c in clients:
                if compare_loaded:
                    run_check(io, c, "snapshot", skip_tensor_list)
                run_check(io, c, "reset_tensors", skip_tensor_list)
            report = transport.update_weights(Export(named_tensors), version)  # re-exported on a fallback
            if on_report is not None:
                on_report(report)
            mismatches: list[TensorMismatch] = []
            for c in clients if compare_loaded else ():
                reply = run_check(io, c, "compare", skip_tensor_list, allow_quant_error)
                if not reply.success:
                    mismatches += compare_failures(c.base_url, reply.message) or [
                        TensorMismatch(
                            engine=c.base_url, name="(unnamed)", reason="differs", detail=reply.message[:500]
                        )
                    ]
            sums = {
                c.base_url: rank_checksums(run_check(io, c, "checksum", skip_tensor_list)) for c in clients
            }
        except PreflightError as e:
            return PreflightResult(passed=False, engines=len(clients), checked_tensors=0, message=str(e))
        mismatches += replica_mismatches(sums)
        checked = len(next(iter(sums.values())))
        if trainer_checksums:
            expected = {n: tensor_hash(t) for n, t in (served or iter)(named_tensors())}
            checked = len(expected)
            for url, got in sums.items():
                mismatches += compare(url, expected, got)
        worst = probe_engines(io, clients, probe) if not mismatches else None
        if mismatches:
            names = sorted({m.name for m in mismatches})
            message = f"{len(names)} tensors differ after the first update: " + ", ".join(names[:20])
        elif not probe_ok(worst, probe):
            assert probe is not None
            message = f"checksums match but the logprob probe differs by {worst:.4f} > {probe.tolerance} (a post-load step skipped?)"
        else:
            message = f"{checked} tensors equal on {len(clients)} engines" + (
                "" if worst is None else f"; logprob probe max diff {worst:.2e}"
            )
        return checked_result(
            engines=len(clients),
            checked=checked,
            mismatches=mismatches,
            worst=worst,
            probe=probe,
            message=message,
        )
