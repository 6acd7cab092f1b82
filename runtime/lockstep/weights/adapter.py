"""Adapter sync: after each step only the LoRA adapter moves, through stock SGLang's LoRA routes.

Why it exists: with spec.model.lora the base never changes, so a weight update is the adapter alone
(a few MiB instead of the model). `AdapterSync` is the WeightTransport of a LoRA job. Each version is
loaded on every engine under its own name (lockstep.serving.lora: `<adapter>-v<version>`; SGLang
refuses to load a name twice, and a name never changes weights, which keeps per-token versions exact
on an engine shared by several jobs). Loading a new name pauses nothing and changes what no other
request samples; the previous version stays loaded so requests still running on it finish, and older
versions are unloaded (SGLang's unload waits for their requests). How the adapter travels follows
spec.weightSync.transport:

| transport | mode | route |
| --- | --- | --- |
| auto (one machine) | `disk`: the version is written as a peft adapter directory under the run dir | /load_lora_adapter {lora_name, lora_path} |
| broadcast | `tensors`: the tensors by value in the request body, sha256 of each checked by the engine | /load_lora_adapter_from_tensors |
| cuda-ipc | `ipc`: CUDA IPC handles (host shared memory on CPU), same route | /load_lora_adapter_from_tensors |

p2p and disk-delta move full weight tensors and are refused with LoRA at apply (rule
streaming-transport-lora). `close` unloads every version this transport loaded, so a job that ends
or is deleted leaves the shared engines as it found them; a run killed before its close (SIGKILL,
OOM) leaves its versions loaded, and the next run of that adapter name (a restarted trainer, the job
created again) unloads them when it first reaches each engine (GET /v1/models lists them).

`check_adapter_update` is the pre-flight of a LoRA job (§7.2.5 on the adapter): it never resets
the base (other jobs may be sampling from it), it checks that every engine holds the same base
(/weights_checker checksum) and that it is the trainer's (each base tensor's hash, where the engine
names tensors as HF does), loads the first version through the transport with every tensor's
sha256 checked by the engine (`tensors`, `ipc`) or read back from the written directory (`disk`),
and probes greedy logprobs of base + adapter against the trainer's.

Who calls it: lockstep.weights.factory (builds it for a LoRA job), lockstep.trainer.local (pre-flight).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lockstep.models.adapter_dir import load_adapter, save_adapter
from lockstep.serving.client import EngineClient, EngineError
from lockstep.serving.loop import LoopThread
from lockstep.serving.lora import adapter_config, parse_served_name, served_name
from lockstep.serving.tensor_codec import dumps_named_tensors, dumps_tensors_by_value
from lockstep.weights import phases
from lockstep.weights.preflight import (
    LogprobProbe,
    PreflightError,
    PreflightResult,
    TensorMismatch,
    checked_result,
    compare,
    engine_clients,
    probe_engines,
    probe_ok,
    rank_checksums,
    replica_mismatches,
    run_check,
    tensor_hash,
)
from lockstep.weights.transport import TransferReport

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Mode = Literal["disk", "tensors", "ipc"]


def sha256_of(t: torch.Tensor) -> str:
    """SGLang's adapter-sync checksum of a tensor: sha256 of its contiguous CPU bytes."""
    import torch

    return hashlib.sha256(
        t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
    ).hexdigest()


class AdapterSync:
    """WeightTransport of a LoRA job (see the module doc)."""

    def __init__(
        self,
        adapter: str,
        *,
        mode: Mode,
        alpha: int,
        dropout: float = 0.0,
        base: str = "",
        root: Path,
        keep: int = 2,
        verify: bool = True,
    ) -> None:
        """adapter: the job's adapter name; alpha/dropout: spec.model.lora's; base: the base checkpoint
        (named in adapter_config.json); root: where `disk` writes versions (the engines must see it at
        the same path); keep: versions left loaded (the newest and, for requests still running on it,
        the one before); verify: send each tensor's sha256 for the engine to check (tensor modes)."""
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the current version stays loaded")
        self.adapter = adapter
        self.mode = mode
        self.name = f"lora-{mode}"
        self.alpha, self.dropout, self.base = alpha, dropout, base
        self.root = Path(root)
        self.keep = keep
        self.verify = verify
        self.loaded: dict[str, list[str]] = {}
        """Engine URL -> the served names this transport loaded there, oldest first."""
        self._io: LoopThread | None = None
        self._clients: dict[str, EngineClient] = {}

    # -- membership ------------------------------------------------------------------------------

    def follow(self, urls: list[str]) -> None:
        """The next update reaches exactly these engines, one that left is forgotten. A joined one
        (every engine, at the start) first loses the versions of this adapter it holds that this
        transport did not load: those of a run of the same adapter name that was killed without its
        close (SIGKILL, OOM, a lost node), which nobody else would ever unload from a shared engine.
        It then gets the next version; until then it serves this job's requests nothing (a joined
        engine is kept out of the router until it holds the job's version: lockstep.progress's
        adapter probe and the operator's readiness gate)."""
        if self._io is None:
            self._io = LoopThread("adapter-io")
        for url in [u for u in self._clients if u not in urls]:
            self._io.run(self._clients.pop(url).aclose())
            self.loaded.pop(url, None)
        joined = [u for u in urls if u not in self._clients]
        for url in joined:
            self._clients[url] = EngineClient(url)
        if joined:
            self._io.run(self._all(joined, self._sweep))

    async def _sweep(self, client: EngineClient) -> None:
        """Unload the versions of this adapter on `client` that this transport did not load."""
        mine = set(self.loaded.get(client.base_url, []))
        try:
            listed = (await client.list_models()).adapters()
        except EngineError as e:  # an engine without --enable-lora: the load fails with SGLang's reason
            log.info("engine %s lists no adapters (%s)", client.base_url, e.message)
            return
        stale = [n for n in listed if n not in mine and (parse_served_name(n) or ("", 0))[0] == self.adapter]
        for name in sorted(stale):
            await client.unload_lora_adapter(name)
        if stale:
            log.warning(
                "engine %s held %d versions of adapter %s that no running job loaded (a run killed before "
                "it could unload them): unloaded %s",
                client.base_url,
                len(stale),
                self.adapter,
                ", ".join(sorted(stale)),
            )

    # -- updates ---------------------------------------------------------------------------------

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> TransferReport:
        """Load the adapter `named_tensors` (peft saved names) as `<adapter>-v<version>` on every
        engine, then unload versions older than the newest `keep`. Raises naming the engine on failure."""
        assert self._io is not None, "follow(urls) first"
        with phases.measure() as timer:
            tensors = {n: t.detach() for n, t in phases.timed(named_tensors, "gather")}
            if not tensors:
                raise ValueError(
                    "adapter sync: the trainer exported no adapter tensors (is spec.model.lora set?)"
                )
            name = served_name(self.adapter, version)
            shapes = {n: t.shape for n, t in tensors.items()}
            config = adapter_config(shapes, alpha=self.alpha, dropout=self.dropout, base=self.base)
            payload_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            with phases.phase("encode"):  # the directory (disk) or the request body (tensors, ipc)
                load, wire = self._loader(name, tensors, config)
            urls = sorted(self._clients)
            with phases.phase("engine_load"):  # each engine checks and loads the adapter; nothing pauses
                self._io.run(self._all(urls, lambda c: self._replace(c, name, load)))
            for url in urls:
                self.loaded.setdefault(url, []).append(name)
            with phases.phase("commit"):  # the version before the previous one leaves the engines
                self._io.run(self._all(urls, self._prune))
        report = TransferReport(
            version=version,
            transport=self.name,
            tensors=len(tensors),
            payload_bytes=payload_bytes,
            wire_bytes=wire * (len(urls) if self.mode == "tensors" else 1),
            extra={"lora_adapter_bytes": float(payload_bytes)},
        )
        return timer.stamp(report)

    def _loader(
        self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, object]
    ) -> tuple[Callable[[EngineClient], Awaitable[Any]], int]:
        """(load one engine, bytes that travel) for this mode."""
        if self.mode == "disk":
            directory = self.root / name
            save_adapter(directory, tensors, config)
            size = sum(f.stat().st_size for f in directory.iterdir())
            return (lambda c: c.load_lora_adapter(name, str(directory))), size
        sums = {n: sha256_of(t) for n, t in tensors.items()} if self.verify else None
        payload = (
            dumps_tensors_by_value(tensors.items())
            if self.mode == "tensors"
            else dumps_named_tensors(tensors.items())
        )
        return (
            lambda c: c.load_lora_adapter_from_tensors(name, config, payload, expected_checksums=sums)
        ), len(payload)

    async def _replace(
        self, client: EngineClient, name: str, load: Callable[[EngineClient], Awaitable[Any]]
    ) -> None:
        """Load `name`; when the engine already holds it (a resumed run publishing a version again) it is
        unloaded first: the weights of a version are the trainer's now, not those of an earlier run."""
        try:
            await load(client)
        except EngineError as e:
            if "already loaded" not in e.message:
                raise
            log.info("engine %s already holds %s: reloading it", client.base_url, name)
            await client.unload_lora_adapter(name)
            await load(client)

    async def _prune(self, client: EngineClient) -> None:
        names = self.loaded.get(client.base_url, [])
        while len(names) > self.keep:
            old = names.pop(0)
            await client.unload_lora_adapter(old)
            if self.mode == "disk":
                shutil.rmtree(self.root / old, ignore_errors=True)

    async def _all(self, urls: Sequence[str], fn: Callable[[EngineClient], Awaitable[Any]]) -> None:
        results = await asyncio.gather(*(fn(self._clients[u]) for u in urls), return_exceptions=True)
        errors = [(u, r) for u, r in zip(urls, results, strict=True) if isinstance(r, BaseException)]
        if errors:
            url, err = errors[0]
            raise RuntimeError(f"adapter sync to {url} failed: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        """Unload every version this transport loaded, on every engine it reached (best effort: an
        engine that is gone is logged, not raised), so shared engines keep only other jobs' adapters."""
        if self._io is None:
            return
        for url, names in self.loaded.items():
            client = self._clients.get(url)
            for name in names if client is not None else ():
                try:
                    self._io.run(client.unload_lora_adapter(name), timeout=60)  # type: ignore[union-attr]
                except Exception as e:  # the engine may be gone with the job
                    log.warning("could not unload adapter %s from %s: %s", name, url, e)
        self.loaded = {}
        for c in self._clients.values():
            self._io.run(c.aclose())
        self._clients = {}
        self._io.close()
        self._io = None


def check_adapter_update(
    engine_urls: list[str],
    transport: AdapterSync,
    named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    *,
    version: int = 0,
    probe: LogprobProbe | None = None,
    base: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
    on_report: Callable[[TransferReport], None] | None = None,
) -> PreflightResult:
    """The pre-flight of a LoRA job (module doc): same base on every engine, the trainer's base equal
    to theirs, the first version loaded with each tensor verified, the logprob probe on base + adapter.
    The base is never reset.

    `base` yields the trainer's frozen base under HF names (the backend's export_base): each tensor's
    hash must equal every engine's /weights_checker checksum of the same name, for engines that name
    and hash tensors as HF does on the CPU (the reference engine); None skips that comparison (SGLang
    fuses and shards tensors, so its names and hashes are not the checkpoint's). `on_report` receives
    the update's TransferReport."""
    with engine_clients(engine_urls, "adapter-preflight-io") as (io, clients):
        try:
            sums = {c.base_url: rank_checksums(run_check(io, c, "checksum")) for c in clients}
            trainer_base = {n: tensor_hash(t) for n, t in base()} if base is not None else {}
            exported = list(named_tensors())
            report = transport.update_weights(exported, version)
            if on_report is not None:
                on_report(report)
        except (PreflightError, RuntimeError) as e:
            return PreflightResult(passed=False, engines=len(clients), checked_tensors=0, message=str(e))
        base_mismatches = [m for url, got in sums.items() for m in compare(url, trainer_base, got)]
        mismatches = base_mismatches + replica_mismatches(sums)
        if transport.mode == "disk":  # the engines loaded the directory: its bytes must be the trainer's
            written, _ = load_adapter(transport.root / served_name(transport.adapter, version))
            for n, t in exported:
                if n not in written or sha256_of(written[n]) != sha256_of(t):
                    mismatches.append(TensorMismatch(engine="(adapter directory)", name=n, reason="checksum"))
        worst = None
        if probe is not None and not mismatches:
            probe.lora_path = served_name(transport.adapter, version)
            worst = probe_engines(io, clients, probe)
        if base_mismatches:  # in the trainer's order: the first one named is the first that differs
            first_bad = base_mismatches[0]
            n_bad = len({m.name for m in base_mismatches})
            message = (
                f"the engine's base differs from the trainer's ({first_bad.engine}): first differing tensor "
                f"{first_bad.name} ({first_bad.reason}{': ' + first_bad.detail if first_bad.detail else ''}); "
                f"{n_bad} of {len(trainer_base)} base tensors differ. The engines must serve "
                "spec.model.checkpoint, the base the adapter trains on"
            )
        elif mismatches:
            names = sorted({m.name for m in mismatches})
            message = f"{len(names)} tensors differ: " + ", ".join(names[:20])
        elif not probe_ok(worst, probe):
            assert probe is not None and worst is not None
            message = f"adapter loaded but the logprob probe differs by {worst:.4f} > {probe.tolerance}"
        else:
            same = (
                f"the trainer's {len(trainer_base)} base tensors on all"
                if base is not None
                else "same base on all"
            )
            message = f"{len(exported)} adapter tensors verified on {len(clients)} engines ({same})" + (
                "" if worst is None else f"; base+adapter logprob probe max diff {worst:.2e}"
            )
        return checked_result(
            engines=len(clients),
            checked=len(exported),
            mismatches=mismatches,
            worst=worst,
            probe=probe,
            message=message,
        )
