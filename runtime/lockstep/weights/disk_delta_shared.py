"""disk-delta per host: the trainer publishes each version once, every engine's agent patches its own copy.

Why it exists: in a cluster, disk-delta (§7.2.4) moves a version through shared storage to engines
that keep full checkpoints on local disk. The trainer (rank 0) writes the whole checkpoint once, at the
first update (`ROOT/base/`, with `baseline.json` and a fresh `ROOT/base/TOKEN`), and after that only
the changed bytes of each version (DeltaPublisher: shards, then the index last); then it asks the
agent beside every engine (lockstep.weights.delta_agent, POST /sync) to patch that engine's own
node-local copy and reload it, and waits for all of them. `update_weights_wire_bytes` and
`update_weights_density` are what the trainer really wrote (the base at the first update, the deltas
after). An engine that joins later is brought up by its agent from the base and the delta chain; an
engine whose agent refuses a version (a corrupt delta, a copy that drifted) keeps its weights and the
update fails naming it and why. The one-machine variant, where the trainer patches every copy itself,
is lockstep.weights.disk_delta_local.

Who calls it: lockstep.weights.factory (disk-delta on a trainer rank in a pod, where the operator
renders the agents).
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from lockstep.api.auth import auth_headers
from lockstep.models import st_bytes as sb
from lockstep.weights import phases
from lockstep.weights.delta_agent import BASE_DIR, SYNC_ROUTE, TOKEN_NAME, AgentState
from lockstep.weights.disk_delta import DeltaError, DeltaPublisher
from lockstep.weights.from_disk import MODEL_FILES, FromDiskTransport
from lockstep.weights.transport import TransferReport

if TYPE_CHECKING:
    import torch

    from lockstep.models.st_bytes import ChecksumAlgorithm

log = logging.getLogger(__name__)


def agent_url(engine_url: str, port: int) -> str:
    """The delta agent beside engine `engine_url`: the same host, the agent's port."""
    parts = urlsplit(engine_url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return urlunsplit((parts.scheme or "http", netloc, "", "", ""))


class SharedDiskDelta:
    """WeightTransport: publish once under `run_dir/delta`, then every engine's agent patches and reloads."""

    name = "disk-delta"

    def __init__(
        self,
        run_dir: Path,
        model_dir: Path,
        urls: Sequence[str],
        *,
        agent_port: int,
        encoding: Any = "xor",
        level: int = 1,
        checksum: ChecksumAlgorithm = "xxh3-128",
        timeout_s: float = 900.0,
        connect_wait_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = Path(run_dir) / "delta"
        """The shared publish root (on the shared volume in a cluster, mounted the same in the engines)."""
        self.model_dir = Path(model_dir)
        """The initial checkpoint (its config and tokenizer files go into the base)."""
        self.urls = sorted(urls)
        self.agent_port = agent_port
        self.encoding, self.level, self.checksum = encoding, level, checksum
        self.timeout_s = timeout_s
        self.connect_wait_s = connect_wait_s
        """How long an agent that does not answer yet is retried (its pod is still starting)."""
        self.clock = clock
        self.publisher: DeltaPublisher | None = None
        self.states: dict[str, AgentState] = {}
        """Engine URL -> its agent's answer to the last sync."""

    def follow(self, urls: list[str]) -> None:
        """Reach exactly these engines from the next update on: a joining engine's agent catches up by
        itself (the base and the delta chain), one that left is simply not asked."""
        self.urls = sorted(urls)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> TransferReport:
        with phases.measure(self.clock) as timer:
            if self.publisher is None or version <= self.publisher.version:
                # The first update, or one that repeats a published version (the driver restarted and
                # resumed, or retries an update some agent refused): versions are immutable, so a new
                # chain from a new base; every agent sees the new TOKEN and copies it.
                tensors, payload, wire, density = self._first(named_tensors, version)
            else:
                result = self.publisher.publish(named_tensors, version)
                tensors, payload, wire, density = (
                    result.tensors,
                    result.total_bytes,
                    result.wire_bytes,
                    result.density,
                )
            with phases.phase("patch"):  # every agent patches its copy and reloads its engine
                self._sync_all(version)
        report = TransferReport(
            version=version,
            transport=self.name,
            tensors=tensors,
            payload_bytes=payload,
            wire_bytes=wire,
            extra={
                "update_weights_density": density,
                "update_weights_wire_bytes": float(wire),
                "update_weights_full_copy_bytes": float(payload),
            },
        )
        return timer.stamp(report)

    def _first(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> tuple[int, int, int, float]:
        """The first update: the whole checkpoint once, as the base every agent copies."""
        shutil.rmtree(self.root, ignore_errors=True)  # a new run (or a resume): a new chain
        writer = FromDiskTransport(
            self.root / BASE_DIR, [], config_dir=self.model_dir, extra_files=MODEL_FILES
        )
        base, count, payload = writer.write(phases.timed(named_tensors, "gather"), version)
        publisher = DeltaPublisher(
            self.root,
            base,
            encoding=self.encoding,
            level=self.level,
            base_version=version,
            checksum=self.checksum,
        )
        with phases.phase("encode"):
            publisher.start()
        sb.write_durable(self.root / BASE_DIR / TOKEN_NAME, uuid.uuid4().hex.encode())
        self.publisher = publisher
        wire = sum(f.stat().st_size for f in base.rglob("*") if f.is_file())
        log.info("disk-delta: base version %d written once (%d bytes) under %s", version, wire, self.root)
        return count, payload, wire, 1.0

    def _sync_all(self, version: int) -> None:
        if not self.urls:
            return
        with ThreadPoolExecutor(max_workers=min(16, len(self.urls)), thread_name_prefix="delta-sync") as pool:
            futures = {u: pool.submit(self._sync, u, version) for u in self.urls}
            errors = []
            for url, fut in futures.items():
                try:
                    self.states[url] = fut.result()
                except DeltaError as e:
                    errors.append(str(e))
        if errors:
            raise DeltaError(f"version {version} did not reach every engine: " + "; ".join(errors))

    def _sync(self, engine: str, version: int) -> AgentState:
        url = agent_url(engine, self.agent_port) + SYNC_ROUTE
        deadline = self.clock() + self.connect_wait_s
        while True:
            try:
                r = httpx.post(url, json={"version": version}, headers=auth_headers(), timeout=self.timeout_s)
                break
            except httpx.ConnectError as e:
                if self.clock() >= deadline:
                    raise DeltaError(
                        f"engine {engine}: its delta agent at {url} does not answer ({e}); the engine pod "
                        "runs it as the `delta-agent` container (kubectl logs <pod> -c delta-agent)"
                    ) from e
                time.sleep(1.0)
        if r.status_code != 200:
            try:
                reason = r.json().get("error", r.text)
            except ValueError:
                reason = r.text
            raise DeltaError(f"engine {engine} refused version {version}: {reason[:1000]}")
        return AgentState.model_validate(r.json())

    def close(self) -> None:
        return None
