"""The disk-delta agent beside each engine: patches the engine's own node-local copy, then reloads it.

Why it exists: disk-delta (§7.2.4) is meant for clusters where the trainer and the engines share no
GPU network but do share storage: the trainer publishes each version once to the shared volume (the
whole checkpoint at the first update, only the changed bytes after), and every engine host keeps its
own full copy on local disk and patches it, off the trainer's critical path. The agent is that host
side, one per engine pod (a sidecar the operator renders for `transport: disk-delta` with a shared
volume). On POST /sync {version} it:

1. makes sure the local copy exists and descends from the trainer's current baseline: a missing copy,
   or one from an earlier baseline (the trainer restarted and wrote a new one, `ROOT/base/TOKEN`),
   is copied from `ROOT/base/` and verified against `ROOT/baseline.json` (init_local);
2. applies every published delta up to `version` (apply_delta: lineage, then the patched tensors'
   checksums against the trainer's, a redo journal; all or nothing per version). A torn version (no
   index) is invisible; a corrupt one fails with the local copy and the engine untouched;
3. reloads the engine from the copy (pause, /update_weights_from_disk, continue): the only step that
   pauses generation;
4. records its state (version, the checksums it holds, what it applied) in `ROOT/agents/<name>.json`
   and answers it; a failure answers 409 with the reason (and is recorded too).

A new engine that joins between updates needs nothing from the trainer: its agent's first sync copies
the base and walks the delta chain. Syncs are serialized. docs/weights.md ("Disk-delta per host").

Who calls it: `lockstep delta agent` (the sidecar's command); the trainer side is
lockstep.weights.disk_delta_shared.SharedDiskDelta (POST /sync to every engine's agent).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lockstep.models import st_bytes as sb
from lockstep.serving.guard import bearer_middleware
from lockstep.weights import disk_delta as dd

log = logging.getLogger(__name__)

BASE_DIR = "base"
"""ROOT/base/weight_vNNNNNN: the one full copy the trainer writes, at the first update."""
TOKEN_NAME = "TOKEN"
"""ROOT/base/TOKEN: names the baseline; a new one (the trainer restarted) means a new chain."""
AGENTS_DIR = "agents"
"""ROOT/agents/<name>.json: each agent's last state."""
LOCAL_TOKEN_NAME = ".lockstep_base_token"
"""The baseline token a local copy descends from."""
SYNC_ROUTE = "/sync"
STATE_ROUTE = "/state"


class SyncRequest(BaseModel):
    """POST /sync body."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0)
    """Bring the local copy and the engine to this published version."""


class AgentState(BaseModel):
    """An agent's state after its last sync (the /sync answer and ROOT/agents/<name>.json)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    """The agent (its engine pod's name)."""
    version: int | None = None
    """The version the local copy holds and the engine was reloaded to; None before the first sync."""
    checksums: dict[str, str] = Field(default_factory=dict)
    """The local copy's tensor checksums (the checksum format of the index), as verified."""
    checksum_format: str = sb.CHECKSUM_FORMAT
    """Algorithm of `checksums`."""
    applied: list[int] = Field(default_factory=list)
    """Versions the last sync applied (empty when already current)."""
    copied_base: bool = False
    """True when the last sync copied the base checkpoint first (a new copy, or a new baseline)."""
    read_bytes: int = 0
    """Compressed delta bytes the last sync read from the shared store."""
    seconds: float = 0.0
    """Wall time of the last sync (patch and reload)."""
    error: str | None = None
    """Why the last sync failed (the copy and the engine were left as they were)."""


def base_dir(root: Path) -> Path:
    """The base checkpoint the trainer wrote at the first update."""
    baseline = dd.LocalState.model_validate_json((Path(root) / dd.BASELINE_NAME).read_bytes())
    return Path(root) / BASE_DIR / f"weight_v{baseline.version:06d}"


class DeltaAgent:
    """Keeps one engine's local copy at the trainer's published versions (see the module doc)."""

    def __init__(
        self, root: Path, local: Path, engine_url: str, *, name: str, pause_mode: str = "retract"
    ) -> None:
        self.root, self.local, self.name = Path(root), Path(local), name
        self.reload = dd.http_reload(engine_url, pause_mode=pause_mode)
        """Pause, /update_weights_from_disk of the local copy at a version, continue."""
        self.state = AgentState(name=name)
        self._lock = threading.Lock()

    def sync(self, version: int) -> AgentState:
        """Patch the local copy up to `version` and reload the engine; raises DeltaError with the
        reason (the copy and the engine unchanged) and records it either way."""
        with self._lock:
            t0 = time.monotonic()
            try:
                copied = self._ensure_local()
                result = dd.apply_delta(self.root, self.local, version)
                self.reload(self.local, version)
            except Exception as e:
                self.state = self.state.model_copy(update={"error": f"{type(e).__name__}: {e}"})
                self._record()
                raise
            local = dd.read_local_state(self.local)
            self.state = AgentState(
                name=self.name, version=local.version, checksum_format=local.checksum_format,
                checksums={n: s.checksum for n, s in local.state.items()}, applied=result.versions,
                copied_base=copied, read_bytes=result.read_bytes, seconds=time.monotonic() - t0,
            )  # fmt: skip
            self._record()
            return self.state

    def _ensure_local(self) -> bool:
        """Copy the base (verified against the baseline) unless the local copy descends from it."""
        token = (self.root / BASE_DIR / TOKEN_NAME).read_text().strip()
        mine = self.local / LOCAL_TOKEN_NAME
        if (
            mine.is_file()
            and mine.read_text().strip() == token
            and (self.local / dd.LOCAL_STATE_NAME).is_file()
        ):
            return False
        base = base_dir(self.root)
        tmp = self.local.with_name(self.local.name + ".copying")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(base, tmp)
        baseline = dd.LocalState.model_validate_json((self.root / dd.BASELINE_NAME).read_bytes())
        dd.init_local(tmp, self.root, baseline.version)  # byte-identical to the trainer's baseline, or raise
        sb.write_durable(tmp / LOCAL_TOKEN_NAME, token.encode())
        shutil.rmtree(self.local, ignore_errors=True)
        os.replace(tmp, self.local)
        log.info("delta agent %s: copied base version %d into %s", self.name, baseline.version, self.local)
        return True

    def _record(self) -> None:
        directory = self.root / AGENTS_DIR
        directory.mkdir(parents=True, exist_ok=True)
        sb.write_durable(directory / f"{self.name}.json", self.state.model_dump_json().encode())


def create_app(agent: DeltaAgent, api_key: str | None = None) -> web.Application:
    """The agent's HTTP app: POST /sync, GET /state, GET /health (the job's key on /sync)."""
    app = web.Application(middlewares=[bearer_middleware(api_key, open_reads={"/health", STATE_ROUTE})])

    async def sync(request: web.Request) -> web.Response:
        try:
            body = SyncRequest.model_validate(await request.json())
        except (ValidationError, ValueError) as e:
            return web.json_response({"error": f"bad /sync body: {e}"}, status=400)
        loop = asyncio.get_running_loop()
        try:
            state = await loop.run_in_executor(None, agent.sync, body.version)
        except (dd.DeltaError, OSError, ValueError) as e:
            log.error("delta agent %s: sync to version %d refused: %s", agent.name, body.version, e)
            return web.json_response({"error": str(e), "state": agent.state.model_dump()}, status=409)
        return web.json_response(state.model_dump())

    async def state(request: web.Request) -> web.Response:
        return web.json_response(agent.state.model_dump())

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_post(SYNC_ROUTE, sync)
    app.router.add_get(STATE_ROUTE, state)
    app.router.add_get("/health", health)
    return app


def serve(agent: DeltaAgent, host: str, port: int, api_key: str | None = None) -> Any:
    """Serve the agent until SIGTERM (blocking)."""
    web.run_app(create_app(agent, api_key), host=host, port=port, print=None, access_log=None)
