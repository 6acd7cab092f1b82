"""The trainer group's command server: rank 0 serves the driver's commands, every rank runs them.

Why it exists: in a cluster the TrainerGroup's ranks own the policy and the driver owns the loop.
`lockstep trainer --serve` runs `serve()` on every rank under torchrun: each rank loads the policy
FSDP2-sharded; rank 0 builds a LocalTrainer over a LeaderBackend (lockstep.trainer.spmd) and serves
lockstep.trainer.wire on aiohttp; ranks > 0 follow rank 0's backend calls. Weights go from the ranks
to the engines directly. Rank 0 binds $POD_IP (loopback outside a pod) and, with the job's key,
requires `Authorization: Bearer <key>` on every command (401 otherwise; health is open); bodies
are capped (413). HTTP: an invalid body is a 400 naming the field, an unknown command a 404,
a command while another runs a 409, a failure a 500 with a typed ErrorReply the driver raises as its
own exception; `shutdown` replies, then every rank exits 0 (docs/trainer.md). SIGTERM drains: new
commands get 503 (`draining`), health says not ready, the running command has `drain_timeout_s` to
finish, then the steps trained since the driver's last save are checkpointed with the state the driver
sent with its last train (preemption: no step is lost), then rank 0 releases the others (which ignore
SIGTERM themselves: they leave when rank 0 says so, or when the launcher kills them), telling them why
(`Ending`); a command still running then is cut off and rank 0 exits 1. A rank exits 0 after the
driver's shutdown or its own SIGTERM (a requested stop); a rank whose group stopped otherwise (a
follower whose rank 0 was deleted, rank 0 drained by a follower's SIGTERM) exits STOPPED_EARLY_EXIT:
the job is not done, so its pod must not end Succeeded (the operator restarts the gang).

Who calls it: lockstep.cli.trainer (`--serve`), tests (2 gloo ranks on loopback).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ValidationError

from lockstep.api import Transport
from lockstep.serving.client import EngineUnreachable
from lockstep.serving.guard import IDLE_TIMEOUT_S, bearer_middleware
from lockstep.serving.listen import listen
from lockstep.serving.membership import DELTA_AGENT_PORT, wait_for_serving
from lockstep.train.factory import build_backend
from lockstep.trainer import telemetry as trainer_metrics
from lockstep.trainer.local import LocalTrainer
from lockstep.trainer.parts import build_trainer_parts
from lockstep.trainer.preempt_notice import default_store, notify_on_sigterm, watch
from lockstep.trainer.protocol import NonFiniteLoss, PreflightFailed
from lockstep.trainer.sft import NoEngines, SFTTrainer
from lockstep.trainer.spmd import LeaderBackend, control_group, follow
from lockstep.trainer.wire import (
    API_PREFIX,
    INSTANCE_HEADER,
    DriverStateWire,
    Empty,
    ErrorKind,
    ErrorReply,
    FirstUpdateReply,
    HealthReply,
    LoadReply,
    MetricsListReply,
    MetricsReply,
    OkReply,
    SaveReply,
    SaveRequest,
    SFTTrainRequest,
    TrainRequest,
    VersionRequest,
    ids_problem,
)
from lockstep.weights.factory import check_transport, wait_for_transport

if TYPE_CHECKING:
    from lockstep.serving.membership import EngineMembers
    from lockstep.trainer.protocol import ServedTrainer
    from lockstep.trainer.settings import TrainerConfig
    from lockstep.weights.preflight import PreflightResult

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 256 << 20
"""Default command body cap: a train batch of long samples is large JSON, but bounded."""
DRAIN_TIMEOUT_S = 25.0
"""Default time a running command gets after SIGTERM (within Kubernetes' default 30 s grace period)."""
STOPPED_EARLY_EXIT = 4
"""A rank's exit code when its group stopped before the driver's shutdown, not on its own SIGTERM."""

Ending = Literal["shutdown", "sigterm", "peer", "error"]
"""Why rank 0 stopped serving (and tells the followers): the driver's `shutdown` (the job is done), its
own SIGTERM, a follower's SIGTERM (`peer`), or an error on rank 0."""
ENDINGS: dict[str, str] = {
    "sigterm": "rank 0 got SIGTERM (its pod deleted or its node drained)",
    "peer": "a follower rank got SIGTERM (its pod deleted or its node drained)",
    "error": "rank 0 failed",
}


def rank_exit(rank: int, ending: str, *, own_sigterm: bool) -> int:
    """The exit code of `rank` once its group stopped for `ending`: 0 after the driver's shutdown or
    this rank's own SIGTERM (a requested stop); else STOPPED_EARLY_EXIT, logged with the cause. A rank
    exiting 0 otherwise would end its pod Succeeded mid-run, a silent success."""
    if ending == "shutdown" or own_sigterm:
        return 0
    log.error(
        "rank %d: the trainer group stopped before the driver's shutdown (%s): the job is not done, "
        "exiting %d (the operator restarts the gang)", rank, ENDINGS.get(ending, ending), STOPPED_EARLY_EXIT,
    )  # fmt: skip
    return STOPPED_EARLY_EXIT


@dataclass(slots=True)
class Command:
    """One command: its request model and what it does on the trainer (blocking, all ranks)."""

    request: type[BaseModel]
    """The body's model (validated before anything runs)."""
    run: Callable[[ServedTrainer, Any], BaseModel]
    """(trainer, validated request) -> reply."""


def _load(t: ServedTrainer, _: Empty) -> LoadReply:
    state = t.load_latest()
    if state is None:
        return LoadReply(state=None)
    return LoadReply(state=DriverStateWire.of(state), path=t.where())


def _sft_train(t: ServedTrainer, r: SFTTrainRequest) -> MetricsReply:
    steps = getattr(t, "sft_train", None)
    if steps is None:
        raise NoEngines("sft_train: this trainer group serves an RL job (spec.recipe rl)")
    return MetricsReply(metrics=steps([(row.input_ids, row.loss_mask) for row in r.rows]))


def _first_update(t: ServedTrainer, r: VersionRequest) -> FirstUpdateReply:
    return FirstUpdateReply(metrics=t.first_update(r.version), preflight=t.preflight_result())


COMMANDS: dict[str, Command] = {
    "warm_start": Command(Empty, lambda t, _: MetricsListReply(steps=list(t.warm_start()))),
    "first_update": Command(VersionRequest, _first_update),
    "train": Command(TrainRequest, lambda t, r: MetricsReply(metrics=t.train([g.group() for g in r.groups]))),
    "update_weights": Command(VersionRequest, lambda t, r: MetricsReply(metrics=t.update_weights(r.version))),
    "save": Command(SaveRequest, lambda t, r: SaveReply(path=t.save(r.state.state()))),
    "load_latest": Command(Empty, _load),
    "shutdown": Command(Empty, lambda t, _: OkReply()),
    "sft_train": Command(SFTTrainRequest, _sft_train),
}
"""The wire's commands (lockstep.trainer.wire documents them)."""


def _error(
    status: int,
    kind: ErrorKind,
    message: str,
    field_path: str | None = None,
    preflight: PreflightResult | None = None,
) -> web.Response:
    body = ErrorReply(kind=kind, message=message, field=field_path, preflight=preflight).model_dump_json()
    return web.Response(status=status, text=body, content_type="application/json")


def _field_of(e: ValidationError) -> tuple[str, str]:
    """(dotted path of the first bad field, one line naming it and the problem)."""
    first = e.errors()[0]
    path = ".".join(str(p) for p in first["loc"]) or "(body)"
    return path, f"{path}: {first['msg']} ({e.error_count()} error(s) in the body)"


def _failure_kind(e: BaseException) -> ErrorKind:
    if isinstance(e, NonFiniteLoss):
        return "non_finite_loss"
    if isinstance(e, PreflightFailed):
        return "preflight_failed"
    if isinstance(e, ValueError | FileNotFoundError):
        return "bad_settings"
    if isinstance(e, EngineUnreachable):  # an engine gone mid-update (scaled down, replaced)
        return "engine_unreachable"
    return "internal"


@dataclass(slots=True)
class CommandServer:
    """The aiohttp side of rank 0: validation, one command at a time, typed errors."""

    trainer: ServedTrainer | None
    """Rank 0's trainer; None until every rank has loaded (health says not ready)."""
    job: str
    """metadata.name of the served job."""
    world_size: int
    """Number of ranks."""
    busy: str | None = None
    """The command running now."""
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)
    """This start's ID (HealthReply.instance)."""
    done: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by `shutdown` after its reply."""
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="lockstep-trainer")
    )
    """The one thread commands run on (the collectives must not run on the event loop)."""
    api_key: str | None = None
    """The job's key: required as `Authorization: Bearer <key>` on every command (health is open)."""
    max_body_bytes: int = MAX_BODY_BYTES
    """Command body cap; larger bodies get 413."""
    draining: bool = False
    """SIGTERM arrived: no new command runs; `done` is set once the running one ended (or timed out)."""
    ending: Ending | None = None
    """Why serving ends, once it does: the driver's `shutdown`, this rank's `sigterm`, a follower's (`peer`)."""
    vocab_size: int | None = None
    """The policy's vocabulary: a train batch with a token ID outside it is a 400 (None: unchecked)."""
    unsaved_state: DriverStateWire | None = None
    """The driver's state after the last trained step when no save has covered it yet: checkpointed on
    SIGTERM (_checkpoint_for_preemption)."""
    idle_timeout_s: float = IDLE_TIMEOUT_S
    """Seconds an idle keep-alive connection stays open."""

    def __post_init__(self) -> None:
        trainer_metrics.READY.set_function(lambda: float(self.trainer is not None and not self.draining))

    def drain(self, timeout_s: float, why: Ending = "sigterm") -> None:
        """Stop taking commands; set `done` when the running command ends, or after `timeout_s`
        (then `busy` still names it). Runs on the event loop (the SIGTERM handler; `why`: `peer` for a
        follower's SIGTERM)."""
        if self.draining:
            return
        self.draining = True
        self.ending = self.ending or why
        log.info("SIGTERM: draining (running: %s, up to %.0f s)", self.busy or "nothing", timeout_s)
        asyncio.get_running_loop().create_task(self._until_idle(timeout_s))

    async def _until_idle(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + timeout_s
        while self.busy is not None and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.busy is None and self.trainer is not None:
            await self._checkpoint_for_preemption(loop.time() - start)
        self.done.set()

    async def _checkpoint_for_preemption(self, waited_s: float) -> None:
        """SIGTERM (a deleted pod, a drained node): checkpoint the steps trained since the driver's last
        save, with the state the driver sent along with the last train (no step is lost: the driver,
        restarted, resumes from it). Nothing to do when the last save is as recent."""
        state = self.unsaved_state
        if state is None or self.trainer is None:
            return
        trainer, loop = self.trainer, asyncio.get_running_loop()
        t0 = loop.time()
        self.busy = "save"
        try:
            path = await loop.run_in_executor(self.pool, trainer.save, state.state())
        except Exception as e:  # the shutdown goes on; the last save stays the latest checkpoint
            log.error("SIGTERM: checkpoint of step %d failed: %s: %s", state.step, type(e).__name__, e)
            return
        finally:
            self.busy = None
        self.unsaved_state = None
        log.warning(
            "SIGTERM: checkpointed step %d to %s in %.2f s (%.2f s after SIGTERM)",
            state.step, path, loop.time() - t0, waited_s + loop.time() - t0,
        )  # fmt: skip

    def app(self) -> web.Application:
        guard = bearer_middleware(self.api_key, open_reads={f"{API_PREFIX}/health"})
        app = web.Application(middlewares=[guard], client_max_size=self.max_body_bytes)
        app.router.add_get(f"{API_PREFIX}/health", self.health)
        app.router.add_post(f"{API_PREFIX}/{{name}}", self.command)
        return app

    async def health(self, request: web.Request) -> web.Response:
        reply = HealthReply(
            ready=self.trainer is not None and not self.draining,
            job=self.job,
            world_size=self.world_size,
            busy=self.busy,
            instance=self.instance,
        )
        return web.Response(text=reply.model_dump_json(), content_type="application/json")

    async def command(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        cmd = COMMANDS.get(name)
        if cmd is None:
            return _error(404, "unknown_command", f"unknown command {name!r}; known: {', '.join(COMMANDS)}")
        if self.draining:
            response = _error(
                503, "draining", "the trainer group is shutting down (SIGTERM); it takes no command"
            )
            response.headers["Retry-After"] = "5"
            return response
        sent = request.headers.get(INSTANCE_HEADER)
        if sent is not None and sent != self.instance:
            return _error(
                409,
                "restarted",
                f"this trainer group started again (instance {self.instance}, the driver attached to {sent}); "
                "its policy is the last checkpoint's: restart the driver to resume from it",
            )
        if self.busy is not None or self.trainer is None:
            what = f"{self.busy!r} is running" if self.busy else "the ranks are still loading"
            return _error(409, "busy", f"{what}; send one command at a time")
        raw = await request.read()
        try:
            body = cmd.request.model_validate_json(raw or b"{}")
        except ValidationError as e:
            path, message = _field_of(e)
            return _error(400, "bad_request", message, path)
        if isinstance(body, TrainRequest) and self.vocab_size is not None:
            outside = ids_problem(body.groups, self.vocab_size)  # before any state changes
            if outside is not None:
                return _error(400, "bad_request", outside[1], outside[0])
        self.busy = name
        trainer = self.trainer
        t0 = time.monotonic()
        try:
            reply = await asyncio.get_running_loop().run_in_executor(self.pool, cmd.run, trainer, body)
            log.info("command %s done in %.2f s", name, time.monotonic() - t0)
            trainer_metrics.COMMANDS.labels(name, "ok").inc()
        except Exception as e:
            trainer_metrics.COMMANDS.labels(name, "error").inc()
            kind = _failure_kind(e)
            log.log(
                logging.ERROR if kind == "internal" else logging.WARNING,
                "command %s failed: %s: %s", name, type(e).__name__, e, exc_info=kind == "internal",
            )  # fmt: skip
            message = f"{type(e).__name__}: {e}" if kind == "internal" else str(e)
            preflight = e.result if isinstance(e, PreflightFailed) else None
            return _error(500, kind, message, preflight=preflight)
        finally:
            self.busy = None
            trainer_metrics.COMMAND_SECONDS.labels(name).observe(time.monotonic() - t0)
        if isinstance(body, TrainRequest) and body.state is not None:
            self.unsaved_state = body.state
        elif isinstance(body, SaveRequest) and body.state.step >= (self.unsaved_state or body.state).step:
            self.unsaved_state = None  # the driver's save covers it
        if name == "shutdown":
            self.ending = self.ending or "shutdown"
            asyncio.get_running_loop().call_later(0.05, self.done.set)  # after the reply is sent
        return web.Response(text=reply.model_dump_json(), content_type="application/json")


async def _serve_http(
    server: CommandServer,
    host: str,
    port: int,
    ready: Callable[[int], None],
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
) -> None:
    """Serve until `shutdown` or SIGTERM's drain; the pool is left running when a command was cut off."""
    if threading.current_thread() is threading.main_thread():  # a signal handler needs the main thread
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, server.drain, drain_timeout_s)
    runner, bound = await listen(
        server.app(), host, port, shutdown_timeout=5.0, keepalive_timeout=server.idle_timeout_s
    )
    ready(bound)
    # a follower's SIGTERM drains the group like rank 0's own (lockstep.trainer.preempt_notice)
    notices = asyncio.create_task(
        watch(
            default_store() if server.world_size > 1 else None,
            lambda: server.drain(drain_timeout_s, "peer"),
        )
    )
    try:
        await server.done.wait()
    finally:
        notices.cancel()
        await runner.cleanup()
        # A command cut off by the drain may be stuck in a collective: its thread is not waited for.
        server.pool.shutdown(wait=server.busy is None, cancel_futures=True)


def serve(
    config: TrainerConfig,
    *,
    out: Path,
    members: EngineMembers,
    host: str = "127.0.0.1",
    port: int = 29600,
    cache_dir: Path | None = None,
    engine_timeout_s: float = 300.0,
    on_listening: Callable[[int], None] | None = None,
    transport_file: Path | None = None,
    transport_timeout_s: float = 300.0,
    in_pod: bool = False,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
    retransport: Callable[[str], TrainerConfig] | None = None,
) -> int:
    """Run this rank of a serving trainer group until `shutdown` or SIGTERM; returns the exit code
    (rank_exit: 0 after the driver's shutdown or this rank's SIGTERM, else STOPPED_EARLY_EXIT).

    Every rank: load the policy sharded. Rank 0: resolve the transport `auto` from
    `transport_file` (the operator's choice; in a pod, `in_pod`, waited for up to `transport_timeout_s`;
    None: the local rule), wait for at least one engine of `members` to serve, build the trainer side
    (its updates follow `members`), serve on host:port (`on_listening(port)` once listening) until
    shutdown. Ranks > 0: follow rank 0 (they send no weights themselves). `retransport(name)` is the
    config with the transport the file chose (lockstep.config.trainer validates it like the manifest).
    """
    model_dir = config.model.resolve(cache_dir, seed=config.settings.seed)
    backend = build_backend(config.backend, model_dir)
    if backend.world_size != config.world_size and backend.rank == 0:
        log.warning(
            "world size %d != spec.trainer.nodes x gpusPerNode = %d", backend.world_size, config.world_size
        )
    trainer_metrics.serve_from_env(backend.rank)  # every rank: no scrape target is down
    try:
        group = control_group()
        if backend.rank != 0:
            # rank 0 then checkpoints and releases it
            sigterm = notify_on_sigterm(default_store(), backend.rank)
            return rank_exit(backend.rank, follow(backend, group), own_sigterm=sigterm.is_set())
        leader = LeaderBackend(backend, group)
        ending: Ending = "error"
        try:
            if config.settings.sft_job:  # no engines: no transport, no engine to wait for
                ending = _serve_sft_rank0(
                    config, leader, model_dir, out, host, port, on_listening,
                    guard=(api_key, max_body_bytes), drain_timeout_s=drain_timeout_s,
                )  # fmt: skip
                return rank_exit(0, ending, own_sigterm=ending == "sigterm")
            # An explicit disk-delta with a shared volume: the operator runs an agent beside every engine.
            agents = (
                in_pod
                and config.transport.transport is Transport.DISK_DELTA
                and config.transport.delta_volume_claim
            )
            if transport_file is not None:
                found = wait_for_transport(
                    config.transport, transport_file, in_pod=in_pod, timeout_s=transport_timeout_s
                )
                log.info(
                    "weight transport %s, chosen by the %s: %s", found.transport, found.source, found.reason
                )
                config = (retransport or partial(_with_transport, config))(found.transport)
            if agents:
                config = replace(
                    config, transport=replace(config.transport, delta_agent_port=DELTA_AGENT_PORT)
                )
            ending = _serve_rank0(
                config, leader, model_dir, out, members, host, port, engine_timeout_s, on_listening,
                guard=(api_key, max_body_bytes), drain_timeout_s=drain_timeout_s,
            )  # fmt: skip
            return rank_exit(0, ending, own_sigterm=ending == "sigterm")
        finally:
            leader.release_followers(ending)
    finally:
        backend.close()


def _serve_sft_rank0(
    config: TrainerConfig,
    leader: Any,
    model_dir: Path,
    out: Path,
    host: str,
    port: int,
    on_listening: Callable[[int], None] | None,
    *,
    guard: tuple[str | None, int],
    drain_timeout_s: float,
) -> Ending:
    """Rank 0 of an SFT job's group: the SFT steps over the sharded policy (lockstep.trainer.sft);
    why it stopped serving."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = config.model.load_tokenizer(model_dir)
    trainer = SFTTrainer(backend=leader, settings=config.settings, run_dir=out, pad_id=tokenizer.pad_token_id)
    server = CommandServer(
        trainer, config.job_name, leader.world_size, api_key=guard[0], max_body_bytes=guard[1]
    )
    log.info(
        "trainer group of %d ranks serves SFT job %s on %s:%d (no engines; checkpoints under %s)",
        leader.world_size, config.job_name, host, port, out,
    )  # fmt: skip
    asyncio.run(_serve_http(server, host, port, on_listening or (lambda p: None), drain_timeout_s))
    if server.busy is not None:
        log.error(
            "command %s still ran after the %.0f s drain; exiting without it", server.busy, drain_timeout_s
        )
        logging.shutdown()
        os._exit(1)
    return server.ending or "error"  # `done` is set only by shutdown or a drain


def _with_transport(config: TrainerConfig, transport: str) -> TrainerConfig:
    """`config` with another transport, unchecked against the manifest's rules (serve's default)."""
    if transport == config.transport.transport:
        return config
    return replace(config, transport=replace(config.transport, transport=Transport(transport)))


def _serve_rank0(
    config: TrainerConfig,
    leader: Any,
    model_dir: Path,
    out: Path,
    members: EngineMembers,
    host: str,
    port: int,
    engine_timeout_s: float,
    on_listening: Callable[[int], None] | None,
    *,
    guard: tuple[str | None, int] = (None, MAX_BODY_BYTES),
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
) -> Ending:
    """Rank 0 of an RL job's group: serve the driver's commands; why it stopped serving."""
    check_transport(config.transport, external_engines=True, cuda_available=leader.device_type == "cuda")
    out.mkdir(parents=True, exist_ok=True)
    closers: list[Callable[[], None]] = []
    try:
        engine_urls = _wait_for_engines(members, engine_timeout_s)
        # Engines join the broadcast weight-update group at rank 0's address: MASTER_ADDR under torchrun
        # (the headless Service's DNS name of rank 0 in a pod).
        master = os.environ.get("MASTER_ADDR", "127.0.0.1")
        parts = build_trainer_parts(config, out, model_dir, leader, engine_urls, closers, master, members)
        server = CommandServer(
            LocalTrainer(parts),
            config.job_name,
            leader.world_size,
            api_key=guard[0],
            max_body_bytes=guard[1],
            vocab_size=_vocab_size(model_dir),
        )
        log.info(
            "trainer group of %d ranks serves job %s on %s:%d (engines from %s, now %s; checkpoints under %s)",
            leader.world_size, config.job_name, host, port, members.describe(), ", ".join(engine_urls), out,
        )  # fmt: skip
        asyncio.run(_serve_http(server, host, port, on_listening or (lambda p: None), drain_timeout_s))
        if server.busy is not None:  # SIGTERM's drain ran out: the command's thread may be stuck
            log.error(
                "command %s still ran after the %.0f s drain; exiting without it",
                server.busy,
                drain_timeout_s,
            )
            logging.shutdown()
            os._exit(1)
    finally:
        for fn in reversed(closers):
            try:
                fn()
            except Exception as e:  # clean-up goes on; logged, not lost
                log.warning("clean-up step failed: %s: %s", type(e).__name__, e)
    return server.ending or "error"  # `done` is set only by shutdown or a drain


def _vocab_size(model_dir: Path) -> int | None:
    """The checkpoint's vocabulary size (config.json, or its text_config), None when it names none."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) and size > 0 else None


_wait_for_engines = wait_for_serving
"""The trainer's name for lockstep.serving.membership.wait_for_serving (rank 0 waits before serving)."""
