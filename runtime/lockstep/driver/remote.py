"""RemoteTrainer: the Trainer protocol over HTTP to rank 0 of the trainer group (`lockstep trainer --serve`).

Why it exists: in a cluster the driver pod has no GPU; the TrainerGroup's ranks hold the policy. The
driver sends one command per loop step (lockstep.trainer.wire) to rank 0, which runs it on all ranks
and replies. Errors raised on the trainer come back typed and are raised here as the same
exceptions the in-process trainer raises, so `lockstep driver` keeps its exit codes:
non-finite loss -> NonFiniteLoss (exit 4), pre-flight failure -> PreflightFailed (exit 5), bad
settings -> ValueError (exit 2). A weight update that lost an engine it had reached (scaled down,
replaced) is repeated a few times, seconds apart (`engine_retry_delays`), before it fails the step. A trainer that cannot be reached is retried with exponential
backoff, then `TrainerUnreachable` (exit 3, like an unreachable engine); a connection lost while a
command runs is not retried (the command may have run) and also raises TrainerUnreachable: the
driver pod restarts and resumes from the trainer's latest checkpoint.

Who calls it: lockstep.driver.policy (when --trainer-url / LOCKSTEP_TRAINER_URL is set), tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from lockstep.api.auth import auth_headers
from lockstep.trainer.protocol import NonFiniteLoss, PreflightFailed
from lockstep.trainer.state import DriverState
from lockstep.trainer.wire import (
    API_PREFIX,
    INSTANCE_HEADER,
    DriverStateWire,
    Empty,
    ErrorReply,
    FirstUpdateReply,
    GroupWire,
    HealthReply,
    LoadReply,
    MetricsListReply,
    MetricsReply,
    OkReply,
    SaveReply,
    SaveRequest,
    SFTRowWire,
    SFTTrainRequest,
    TrainRequest,
    VersionRequest,
)
from lockstep.types import Group
from lockstep.weights.preflight import PREFLIGHT_FILE, PreflightResult

log = logging.getLogger(__name__)

_R = TypeVar("_R", bound=BaseModel)


class TrainerUnreachable(ConnectionError):
    """No connection to the trainer group's rank 0; the message names the URL and the fix."""

    def __init__(self, url: str, what: str, cause: BaseException | None = None) -> None:
        detail = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        super().__init__(
            f"trainer at {url} {what}{detail}; check that the trainer group's rank 0 runs "
            "`lockstep trainer --serve` and that --trainer-url / LOCKSTEP_TRAINER_URL (host, port) is right"
        )
        self.url = url
        """The trainer URL."""


class TrainerCommandError(RuntimeError):
    """The trainer failed a command for a reason the driver cannot fix (the message says which)."""


class EngineGone(TrainerCommandError):
    """A weight update failed because an engine it had reached stopped answering (the message names it)."""


def engine_retry_delays(retries: int, first_s: float) -> list[float]:
    """Seconds to wait before each repeat of a weight update that lost an engine (pure): doubling.

    An engine scaled down or replaced stays listed by the pool's headless Service (it publishes
    not-ready addresses) until its pod is gone, up to its preStop pause plus its drain after the
    update reached it; the trainer reads the engines again on every update, so a repeat a little
    later reaches only those that are still there."""
    return [first_s * 2**k for k in range(max(retries, 0))]


def error_from_reply(url: str, command: str, err: ErrorReply) -> Exception:
    """The driver-side exception for a typed trainer error (pure)."""
    if err.kind in ("restarted", "draining"):  # exit 3: the driver restarts and resumes from the checkpoint
        return TrainerUnreachable(url, f"refused {command}: {err.message}")
    if err.kind == "non_finite_loss":
        return NonFiniteLoss(err.message)
    if err.kind == "preflight_failed":
        return PreflightFailed(err.message, err.preflight)
    if err.kind == "bad_settings":
        return ValueError(err.message)
    if err.kind == "engine_unreachable":
        return EngineGone(f"trainer command {command}: {err.message}")
    where = f" (field {err.field})" if err.field else ""
    return TrainerCommandError(f"trainer command {command}: {err.kind}: {err.message}{where}")


class RemoteTrainer:
    """The Trainer protocol (lockstep.trainer.protocol) served by a trainer group's rank 0."""

    def __init__(
        self,
        url: str,
        *,
        retries: int = 5,
        backoff_s: float = 0.5,
        engine_retries: int = 4,
        engine_retry_s: float = 5.0,
        sleep: Callable[[float], None] = time.sleep,
        transport: httpx.BaseTransport | None = None,
        run_dir: Path | None = None,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        """Base URL of rank 0's command server, e.g. http://trainer-0.trainer.ns.svc:29600."""
        self.retries = max(retries, 1)
        """Connection attempts per command before TrainerUnreachable."""
        self.backoff_s = backoff_s
        """First retry delay; doubles per attempt."""
        self.sleep = sleep
        """Injected sleep (tests)."""
        self.engine_delays = engine_retry_delays(engine_retries, engine_retry_s)
        """Waits before repeating a weight update that lost an engine (5, 10, 20, 40 s: 75 s in all)."""
        # A train step or an update may take minutes: no read timeout; connecting must be quick.
        timeout = httpx.Timeout(None, connect=10.0)
        self.http = httpx.Client(
            base_url=self.url, timeout=timeout, transport=transport, headers=auth_headers(api_key)
        )
        """The HTTP connection pool."""
        self.run_dir = run_dir
        """The driver's run dir: the trainer's pre-flight result is mirrored there (PREFLIGHT_FILE), where
        the progress channel reads it, as with an in-process trainer."""
        self.next_state: DriverState | None = None
        """Sent with the next train (announce_state)."""
        self.instance: str | None = None
        """The trainer group's instance ID seen by wait_ready, sent with every command."""

    # -- the Trainer protocol -------------------------------------------------------------------

    def warm_start(self) -> Iterator[dict[str, float]]:
        yield from self._call("warm_start", Empty(), MetricsListReply).steps

    def first_update(self, version: int) -> dict[str, float]:
        try:
            reply = self._call("first_update", VersionRequest(version=version), FirstUpdateReply)
        except PreflightFailed as e:
            self._mirror_preflight(e.result)
            raise
        self._mirror_preflight(reply.preflight)
        return reply.metrics

    def _mirror_preflight(self, result: PreflightResult | None) -> None:
        if self.run_dir is None:
            return
        path = Path(self.run_dir) / PREFLIGHT_FILE
        if result is None:
            path.unlink(missing_ok=True)  # a result of an earlier start is not this one's
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(result.model_dump_json(indent=2) + "\n")

    def train(self, groups: list[Group]) -> dict[str, float]:
        state = DriverStateWire.of(self.next_state) if self.next_state is not None else None
        self.next_state = None
        body = TrainRequest(groups=[GroupWire.of(g) for g in groups], state=state)
        return self._call("train", body, MetricsReply).metrics

    def announce_state(self, state: DriverState) -> None:
        """The loop's state once the next train step (and its update) is done: sent with that train, so
        the trainer group can checkpoint it if SIGTERM comes before the next save (preemption)."""
        self.next_state = state

    def sft_train(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict[str, float]:
        """One step of an SFT job on the trainer group (lockstep.trainer.sft)."""
        body = SFTTrainRequest(rows=[SFTRowWire(input_ids=list(i), loss_mask=list(m)) for i, m in rows])
        return self._call("sft_train", body, MetricsReply).metrics

    def update_weights(self, version: int) -> dict[str, float]:
        """The update to `version`; repeated (same version) while it fails only because an engine it had
        reached is gone: a scale-down or a replaced engine costs seconds, not a driver restart."""
        for delay in [*self.engine_delays, None]:
            try:
                return self._call("update_weights", VersionRequest(version=version), MetricsReply).metrics
            except EngineGone as e:
                if delay is None:
                    raise
                log.warning(
                    "weight update to version %d lost an engine (%s); again in %.0f s", version, e, delay
                )
                self.sleep(delay)
        raise AssertionError("unreachable")

    def save(self, state: DriverState) -> str:
        return self._call("save", SaveRequest(state=DriverStateWire.of(state)), SaveReply).path

    def load_latest(self) -> DriverState | None:
        reply = self._call("load_latest", Empty(), LoadReply)
        if reply.state is None:
            return None
        log.info("trainer restored %s", reply.path)
        return reply.state.state()

    def where(self) -> str:
        """Named in errors: the trainer keeps the checkpoints."""
        return f"the trainer at {self.url}"

    def shutdown(self) -> None:
        """End every trainer rank (exit 0): the job is done."""
        self._call("shutdown", Empty(), OkReply)

    def close(self) -> None:
        self.http.close()

    # -- transport --------------------------------------------------------------------------------

    def wait_ready(self, job: str, timeout_s: float = 600.0, poll_s: float = 1.0) -> HealthReply:
        """Poll GET /v2/health until every rank has loaded and no command (of a driver that died during
        it) is running; refuse a trainer serving another job."""
        deadline = time.monotonic() + timeout_s
        last: BaseException | None = None
        while True:
            try:
                r = self.http.get(f"{API_PREFIX}/health")
                health = HealthReply.model_validate_json(r.content)
                if health.job != job:
                    raise ValueError(
                        f"trainer at {self.url} serves job {health.job!r}, not {job!r}; "
                        "point --trainer-url at this job's trainer group"
                    )
                if health.ready and health.busy is None:  # a previous driver's command may still run
                    self.instance = health.instance
                    return health
            except (httpx.TransportError, ValidationError) as e:
                last = e
            if time.monotonic() + poll_s > deadline:
                raise TrainerUnreachable(self.url, f"not ready within {timeout_s:.0f} s", last)
            self.sleep(poll_s)

    def _call(self, command: str, body: BaseModel, reply: type[_R]) -> _R:
        path = f"{API_PREFIX}/{command}"
        content = body.model_dump_json()
        headers = {"content-type": "application/json"}
        if self.instance is not None:
            headers[INSTANCE_HEADER] = self.instance
        for attempt in range(self.retries):
            try:
                r = self.http.post(path, content=content, headers=headers)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # not sent: safe to retry
                if attempt + 1 == self.retries:
                    raise TrainerUnreachable(self.url, f"unreachable after {self.retries} attempts", e) from e
                delay = self.backoff_s * 2**attempt
                log.warning("trainer at %s unreachable (%s); retrying in %.1f s", self.url, e, delay)
                self.sleep(delay)
            except httpx.TransportError as e:  # sent: the command may have run, so no retry
                raise TrainerUnreachable(self.url, f"lost the connection during {command}", e) from e
        if r.status_code == 200:
            return reply.model_validate_json(r.content)
        try:
            err = ErrorReply.model_validate_json(r.content)
        except ValidationError:
            raise TrainerCommandError(
                f"trainer command {command}: HTTP {r.status_code}: {r.text[:300]}"
            ) from None
        raise error_from_reply(self.url, command, err)
