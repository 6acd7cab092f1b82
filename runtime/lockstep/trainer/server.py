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
finish, then every rank exits 0 (rank 0 releases the others, which ignore SIGTERM themselves: they
leave when rank 0 says so, or when the launcher kills them); a command still running then is cut
off and rank 0 exits 1.

Who calls it: lockstep.cli.trainer (`--serve`), tests (2 gloo ranks on loopback).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from lockstep.models import resolve_checkpoint
from lockstep.serving.client import EngineUnreachable
from lockstep.serving.guard import bearer_middleware
from lockstep.serving.membership import wait_for_serving
from lockstep.trainer.local import LocalTrainer, build_backend, build_trainer_parts
from lockstep.trainer.protocol import NonFiniteLoss, PreflightFailed
from lockstep.trainer.settings import TrainerSettings
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
    TrainRequest,
    VersionRequest,
)
from lockstep.weights.factory import check_transport, wait_for_transport, with_transport

if TYPE_CHECKING:
    from lockstep.api import RLJob
    from lockstep.serving.membership import EngineMembers
    from lockstep.trainer.protocol import ServedTrainer
    from lockstep.weights.preflight import PreflightResult

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 256 << 20
"""Default command body cap: a train batch of long samples is large JSON, but bounded."""
DRAIN_TIMEOUT_S = 25.0
"""Default time a running command gets after SIGTERM (within Kubernetes' default 30 s grace period)."""


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

    def drain(self, timeout_s: float) -> None:
        """Stop taking commands; set `done` when the running command ends, or after `timeout_s`
        (then `busy` still names it). Runs on the event loop (the SIGTERM handler)."""
        if self.draining:
            return
        self.draining = True
        log.info("SIGTERM: draining (running: %s, up to %.0f s)", self.busy or "nothing", timeout_s)
        asyncio.get_running_loop().create_task(self._until_idle(timeout_s))

    async def _until_idle(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.busy is not None and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.done.set()

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
        self.busy = name
        trainer = self.trainer
        t0 = time.monotonic()
        try:
            reply = await asyncio.get_running_loop().run_in_executor(self.pool, cmd.run, trainer, body)
            log.info("command %s done in %.2f s", name, time.monotonic() - t0)
        except Exception as e:
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
        if name == "shutdown":
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
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []
    ready(sockets[0].getsockname()[1] if sockets else port)
    try:
        await server.done.wait()
    finally:
        await runner.cleanup()
        # A command cut off by the drain may be stuck in a collective: its thread is not waited for.
        server.pool.shutdown(wait=server.busy is None, cancel_futures=True)


def serve(
    job: RLJob,
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
) -> int:
    """Run this rank of a serving trainer group until `shutdown` or SIGTERM; returns the exit code (0).

    Every rank: load the policy sharded. Rank 0: resolve spec.weightSync.transport `auto` from
    `transport_file` (the operator's choice; in a pod, `in_pod`, waited for up to `transport_timeout_s`;
    None: the local rule), wait for at least one engine of `members` to serve, build the trainer side
    (its updates follow `members`), serve on host:port (`on_listening(port)` once listening) until
    shutdown. Ranks > 0: follow rank 0 (they send no weights themselves).
    """
    settings = TrainerSettings.from_job(job)
    model_dir = resolve_checkpoint(job.spec.model.checkpoint, cache_dir=cache_dir, seed=settings.seed)
    backend = build_backend(job, settings, model_dir)
    want = job.spec.trainer.nodes * job.spec.trainer.gpus_per_node
    if backend.world_size != want and backend.rank == 0:
        log.warning("world size %d != spec.trainer.nodes x gpusPerNode = %d", backend.world_size, want)
    try:
        group = control_group()
        if backend.rank != 0:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, _follower_sigterm)
            follow(backend, group)
            return 0
        leader = LeaderBackend(backend, group)
        try:
            if transport_file is not None:
                job = _resolve_transport(job, transport_file, timeout_s=transport_timeout_s, in_pod=in_pod)
            return _serve_rank0(
                job, leader, model_dir, out, members, host, port, engine_timeout_s, on_listening,
                guard=(api_key, max_body_bytes), drain_timeout_s=drain_timeout_s,
            )  # fmt: skip
        finally:
            leader.release_followers()
    finally:
        backend.close()


def _follower_sigterm(signum: int, frame: Any) -> None:
    """Ranks > 0 stay for rank 0's running command (it is collective) and leave when rank 0 says so."""
    log.info("SIGTERM: rank 0 drains and then releases this rank")


def _resolve_transport(job: RLJob, path: Path, *, timeout_s: float, in_pod: bool) -> RLJob:
    """`job` with spec.weightSync.transport resolved (lockstep.weights.factory); logs the choice."""
    found = wait_for_transport(job, path, in_pod=in_pod, timeout_s=timeout_s)
    log.info("weight transport %s, chosen by the %s: %s", found.transport, found.source, found.reason)
    return with_transport(job, found.transport)


def _serve_rank0(
    job: RLJob,
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
) -> int:
    settings = TrainerSettings.from_job(job)
    check_transport(job, external_engines=True, cuda_available=leader.device_type == "cuda")
    out.mkdir(parents=True, exist_ok=True)
    closers: list[Callable[[], None]] = []
    try:
        engine_urls = _wait_for_engines(members, engine_timeout_s)
        # Engines join the broadcast weight-update group at rank 0's address: MASTER_ADDR under torchrun
        # (the headless Service's DNS name of rank 0 in a pod).
        master = os.environ.get("MASTER_ADDR", "127.0.0.1")
        parts = build_trainer_parts(
            job, settings, out, model_dir, leader, engine_urls, closers, master, members
        )
        server = CommandServer(
            LocalTrainer(parts),
            job.metadata.name,
            leader.world_size,
            api_key=guard[0],
            max_body_bytes=guard[1],
        )
        log.info(
            "trainer group of %d ranks serves job %s on %s:%d (engines from %s, now %s; checkpoints under %s)",
            leader.world_size, job.metadata.name, host, port, members.describe(), ", ".join(engine_urls), out,
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
    return 0


_wait_for_engines = wait_for_serving
"""The trainer's name for lockstep.serving.membership.wait_for_serving (rank 0 waits before serving)."""
