"""Disk-delta weight transport: publish a version as changed bytes, patch local checkpoints (§7.2.4).

Why it exists: when trainer and engines share no NCCL or RDMA network but do share storage and keep a
full checkpoint on local disk, the trainer publishes only the bytes that changed since the previous
version and every engine host patches its own copy, then reloads it. The life cycle, as the spec
orders it: the first update publishes nothing (both sides start from one verified snapshot); later
versions are diffed, encoded and compressed (delta_codec.py), published as shards plus an index
written last (its presence marks a complete version), applied with lineage and checksum checks and a
redo journal (a failure leaves the checkpoint as it was), and only then reloaded. docs/weights.md has
the on-disk format; lockstep.weights.disk_delta_local keeps one engine copy per engine for a run.

Who calls it: the trainer through LocalDiskDelta, engine pods through apply_delta, operators through
`lockstep delta` (cli/delta.py).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from lockstep.models import st_bytes as sb
from lockstep.serving import EngineClient, EngineError
from lockstep.serving.loop import LoopThread
from lockstep.weights import delta_codec as codec
from lockstep.weights import phases
from lockstep.weights.delta_encoder import encode_all
from lockstep.weights.transport import TransferReport

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
BASELINE_NAME = "baseline.json"
LOCAL_STATE_NAME = ".lockstep_weights.json"
JOURNAL_NAME = ".lockstep_apply.json"
DEFAULT_SHARD_BYTES = 512 * 1024 * 1024
"""A delta shard is closed once its compressed payloads pass this size."""


def version_dir(root: Path, version: int) -> Path:
    """ROOT/weight_vNNNNNN for a version."""
    return root / f"weight_v{version:06d}"


class DeltaError(RuntimeError):
    """Base of every disk-delta failure; the message names the tensor or file and the fix."""


class SnapshotMismatchError(DeltaError):
    """Trainer export and checkpoint (or two hosts' version 0) are not byte-identical in layout."""


class ReplicaMismatchError(DeltaError):
    """One replicated tensor published with two different checksums."""


class LineageError(DeltaError):
    """The local checkpoint is not the version the delta is based on."""


class CorruptDeltaError(DeltaError):
    """A shard is missing, truncated or decodes to bytes whose checksum is not the target's."""


class TensorState(BaseModel):
    """Layout and checksum of one tensor of a version."""

    model_config = ConfigDict(extra="forbid")
    dtype: str
    """safetensors dtype name."""
    shape: list[int]
    """Tensor shape."""
    nbytes: int
    """Byte size (elements x element size)."""
    checksum: str
    """Checksum (the index's or marker's checksum_format) of the tensor's bytes in this version."""


class DeltaTensor(BaseModel):
    """One changed tensor of a published version."""

    model_config = ConfigDict(extra="forbid")
    shard: str
    """File name of the delta shard (inside weight_vNNNNNN/) holding the compressed payload."""
    base_checksum: str
    """Checksum of the tensor in the base version (lineage check before patching)."""
    raw_bytes: int
    """Size of the uncompressed encoded delta."""
    changed_bytes: int
    """Bytes that differ from the base."""


class DeltaIndex(BaseModel):
    """model.safetensors.index.json of a version: written last, its presence marks a complete version."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["lockstep-disk-delta/1"] = "lockstep-disk-delta/1"
    """Format tag, bumped on incompatible changes."""
    version: int
    """The weight version this delta produces."""
    base_version: int
    """The version it must be applied to."""
    encoding: codec.Encoding
    """xor (apply exactly once) or overwrite (idempotent)."""
    compression: Literal["zstd"] = "zstd"
    """Compression of every payload."""
    compression_level: int = codec.DEFAULT_ZSTD_LEVEL
    """zstd level used."""
    checksum_format: sb.ChecksumAlgorithm = "xxh3-128"
    """Checksum of tensors' bytes, before and after (the publisher's choice; subscribers follow it)."""
    weight_map: dict[str, str] = Field(default_factory=dict)
    """Changed tensor name -> delta shard file (as in HF index files)."""
    tensors: dict[str, DeltaTensor] = Field(default_factory=dict)
    """Changed tensors; unchanged ones are absent."""
    state: dict[str, TensorState] = Field(default_factory=dict)
    """Target state of EVERY tensor of the version (what the patched checkpoint must hold)."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """update_weights_density and update_weights_wire_bytes of this publish."""


class LocalState(BaseModel):
    """A local checkpoint's version marker, written after every successful patch."""

    model_config = ConfigDict(extra="forbid")
    version: int
    """Version the checkpoint files hold."""
    state: dict[str, TensorState]
    """Layout and checksum of every tensor."""
    checksum_format: sb.ChecksumAlgorithm = "xxh3-128"
    """Algorithm of the checksums in `state`."""


class Journal(BaseModel):
    """Redo log of a patch in progress: verified temp files to rename over the originals."""

    model_config = ConfigDict(extra="forbid")
    renames: list[tuple[str, str]]
    """(temp file name, final file name) pairs inside the local directory."""
    local: LocalState
    """The marker to write once every rename is done."""


@dataclass(slots=True)
class PublishResult:
    """What one publish wrote."""

    version: int
    """Version published (or the baseline version for start())."""
    tensors: int = 0
    """Tensors in the version."""
    changed_tensors: int = 0
    """Tensors that had at least one changed byte."""
    total_bytes: int = 0
    """Bytes of the whole model."""
    changed_bytes: int = 0
    """Bytes that differ from the base version."""
    wire_bytes: int = 0
    """Bytes written to the shared store (shards + index): update_weights_wire_bytes."""

    @property
    def density(self) -> float:
        """update_weights_density: changed bytes / total bytes."""
        return self.changed_bytes / self.total_bytes if self.total_bytes else 0.0


def _state_of(dtype: str, shape: Iterable[int], data: np.ndarray, algorithm: str) -> TensorState:
    return TensorState(
        dtype=dtype, shape=list(shape), nbytes=int(data.size), checksum=sb.checksum(data, algorithm)
    )


def _layout_diffs(
    expected: dict[str, tuple[str, list[int], int]], got: dict[str, tuple[str, list[int], int]]
) -> list[str]:
    diffs = [f"{n}: missing from the export" for n in sorted(expected.keys() - got.keys())]
    diffs += [f"{n}: not in the checkpoint" for n in sorted(got.keys() - expected.keys())]
    for n in sorted(expected.keys() & got.keys()):
        if expected[n] != got[n]:
            e, g = expected[n], got[n]
            diffs.append(f"{n}: checkpoint (dtype, shape, bytes)={e}, export={g}")
    return diffs


class DeltaPublisher:
    """Trainer side: holds the previous version's bytes and publishes each new version's delta."""

    def __init__(
        self,
        root: Path,
        baseline: Path,
        *,
        encoding: codec.Encoding = "xor",
        level: int = codec.DEFAULT_ZSTD_LEVEL,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        base_version: int = 0,
        checksum: sb.ChecksumAlgorithm = sb.CHECKSUM_FORMAT,
        workers: int | None = None,
    ) -> None:
        if encoding not in codec.ENCODINGS:
            raise ValueError(f"encoding must be one of {codec.ENCODINGS}, got {encoding!r}")
        if checksum not in sb.CHECKSUM_ALGORITHMS:
            raise ValueError(f"checksum must be one of {sb.CHECKSUM_ALGORITHMS}, got {checksum!r}")
        self.checksum: sb.ChecksumAlgorithm = checksum
        self.root = Path(root)
        self.encoding: codec.Encoding = encoding
        self.level = level
        self.shard_bytes = shard_bytes
        self.version = base_version
        # The byte baseline comes from the canonical checkpoint on disk, not the trainer's tensors, so
        # that trainer and engines start from the same bytes (§7.2.4 step 1). [nbytes] uint8 each.
        self._snapshot: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {
            e.name: (e.dtype, e.shape, np.array(data)) for e, data in sb.iter_checkpoint_bytes(Path(baseline))
        }
        self._spare: dict[str, np.ndarray] = {}
        """Per tensor, the buffer the next version's bytes are copied into (swapped with the base at
        each publish): two copies of the model live on the trainer host, allocated once."""
        self._sums: dict[str, str] = {}
        """Checksums (`checksum`) of the snapshot's tensors, where known: the base of the next delta."""
        self.workers = workers
        """Encoder threads of a publish (None: every core this process may use)."""

    def layout(self) -> dict[str, tuple[str, list[int], int]]:
        return {n: (d, list(s), int(b.size)) for n, (d, s, b) in self._snapshot.items()}

    def check_export(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fail before training unless the export matches the checkpoint in name, dtype, shape, bytes."""
        got = {}
        for name, t in phases.timed(named_tensors, "gather"):
            got[name] = (sb.st_dtype(t), list(t.shape), t.numel() * t.element_size())
        diffs = _layout_diffs(self.layout(), got)
        if diffs:
            raise SnapshotMismatchError(
                f"trainer export does not match the baseline checkpoint ({len(diffs)} differences): "
                + "; ".join(diffs[:20])
                + ". Export from the same HF checkpoint the engines load."
            )

    def check_base(self) -> None:
        """Raise LineageError unless the snapshot is exactly the last version published under root.

        Guards `lockstep delta publish --base DIR`: a delta diffed against the wrong base would be
        rejected by every subscriber, so it is refused before anything is written.
        """
        if self.version == 0 or not published_versions(self.root):
            path = self.root / BASELINE_NAME
            if not path.is_file():
                return  # nothing recorded yet: start() will record this snapshot as the baseline
            marker = LocalState.model_validate_json(path.read_bytes())
            expected, algorithm = marker.state, marker.checksum_format
        else:
            index = load_index(self.root, self.version)
            expected, algorithm = index.state, index.checksum_format
        want = {n: st.checksum for n, st in expected.items()}
        got = {n: sb.checksum(b, algorithm) for n, (_, _, b) in self._snapshot.items()}
        bad = sorted(n for n in want.keys() | got.keys() if want.get(n) != got.get(n))
        if bad:
            raise LineageError(
                f"the base snapshot is not version {self.version} as published under {self.root}: "
                f"{len(bad)} tensors differ (e.g. {bad[:5]}); pass the checkpoint of the last published version"
            )

    def start(self) -> PublishResult:
        """The first update: publish nothing, record the baseline's checksums for the engines to verify."""
        self.root.mkdir(parents=True, exist_ok=True)
        state = {n: _state_of(d, s, b, self.checksum) for n, (d, s, b) in self._snapshot.items()}
        self._sums = {n: st.checksum for n, st in state.items()}
        marker = LocalState(version=self.version, state=state, checksum_format=self.checksum)
        sb.write_durable(self.root / BASELINE_NAME, marker.model_dump_json().encode())
        total = sum(int(b.size) for _, _, b in self._snapshot.values())
        return PublishResult(version=self.version, tensors=len(state), total_bytes=total)

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PublishResult:
        """Diff every tensor against the previous version and publish weight_v{version}/ (index last)."""
        if version <= self.version:
            raise DeltaError(f"version {version} must be greater than the last published {self.version}")
        out = version_dir(self.root, version)
        if (out / INDEX_NAME).exists():
            raise DeltaError(f"{out} is already published; versions are immutable")
        shutil.rmtree(out, ignore_errors=True)  # a torn earlier attempt (no index): start over
        out.mkdir(parents=True)
        try:
            with phases.phase("encode"):
                index, new_bytes, result = self._write_shards(named_tensors, version, out)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
        raw = index.model_dump_json().encode()
        result.wire_bytes += len(raw)
        index.metrics["update_weights_wire_bytes"] = float(result.wire_bytes)
        index.metrics["update_weights_density"] = result.density
        with phases.phase("transfer"):
            sb.write_durable(out / INDEX_NAME, index.model_dump_json().encode())
        for name, (data, digest) in new_bytes.items():  # the spare becomes the base and vice versa
            d, s, old = self._snapshot[name]
            self._snapshot[name] = (d, s, data)
            self._spare[name] = old
            self._sums[name] = digest
        self.version = version
        return result

    def _write_shards(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, out: Path
    ) -> tuple[DeltaIndex, dict[str, tuple[np.ndarray, str]], PublishResult]:
        """Encode every tensor against the snapshot (delta_encoder, on `workers` threads) and write the
        changed ones into shards; returns the index (without metrics), the new bytes and checksums of
        the changed tensors (the next snapshot) and the counts."""
        index = DeltaIndex(
            version=version,
            base_version=self.version,
            encoding=self.encoding,
            compression_level=self.level,
            checksum_format=self.checksum,
        )
        result = PublishResult(version=version)
        new_bytes: dict[str, tuple[np.ndarray, str]] = {}
        replicas: list[tuple[str, np.ndarray]] = []
        shard: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
        shard_size = 0

        def flush() -> None:
            nonlocal shard, shard_size
            if not shard:
                return
            path = out / f"delta-{len(set(index.weight_map.values())):05d}.safetensors"
            with phases.phase("transfer"):
                sb.write_safetensors_bytes(path, shard)
            for name in shard:
                index.weight_map[name] = path.name
            result.wire_bytes += path.stat().st_size
            shard, shard_size = {}, 0

        layouts: dict[str, TensorState] = {}

        def jobs() -> Iterator[tuple[str, np.ndarray, str | Callable[[], str], np.ndarray, np.ndarray]]:
            for name, tensor in phases.timed(named_tensors, "gather"):
                data = sb.tensor_bytes(tensor)
                layout = (sb.st_dtype(tensor), list(tensor.shape), int(data.size))
                if name in layouts:  # a replicated tensor (e.g. tied embeddings from two stages)
                    replicas.append((name, np.array(data)))
                    continue
                base = self._snapshot.get(name)
                if base is None or (base[0], list(base[1]), int(base[2].size)) != layout:
                    want = None if base is None else (base[0], list(base[1]), int(base[2].size))
                    raise SnapshotMismatchError(f"tensor {name!r}: base has {want}, export has {layout}")
                layouts[name] = TensorState(dtype=layout[0], shape=layout[1], nbytes=layout[2], checksum="")
                spare = self._spare.get(name)
                if spare is None:  # allocated once, then reused version after version (no page faults)
                    spare = self._spare[name] = np.empty_like(base[2])
                yield name, base[2], self._base_checksum(name), data, spare

        for name, enc in encode_all(
            jobs(), encoding=self.encoding, level=self.level, checksum=self.checksum, workers=self.workers
        ):
            st = layouts[name]
            st.checksum = enc.checksum
            index.state[name] = st
            result.total_bytes += st.nbytes
            if enc.frame is None or enc.new is None:
                continue
            shard[name] = ("U8", (len(enc.frame),), enc.frame)
            shard_size += len(enc.frame)
            index.tensors[name] = DeltaTensor(
                shard="", base_checksum=self._base_checksum(name)(), raw_bytes=enc.raw_bytes,
                changed_bytes=enc.changed,
            )  # fmt: skip
            new_bytes[name] = (enc.new, enc.checksum)
            result.changed_tensors += 1
            result.changed_bytes += enc.changed
            if shard_size >= self.shard_bytes:
                flush()
        flush()
        for name, data in replicas:
            got = sb.checksum(data, self.checksum)
            if index.state[name].checksum != got:
                raise ReplicaMismatchError(
                    f"tensor {name!r} was published twice with different checksums "
                    f"({index.state[name].checksum} vs {got}); replicas diverged, nothing was published"
                )
        missing = sorted(self._snapshot.keys() - index.state.keys())
        if missing:
            raise SnapshotMismatchError(
                f"the export lacks {len(missing)} tensors of the base (e.g. {missing[:5]}); an update must be complete"
            )
        for name, entry in index.tensors.items():
            entry.shard = index.weight_map[name]
        result.tensors = len(index.state)
        return index, new_bytes, result

    def _base_checksum(self, name: str) -> Callable[[], str]:
        """The snapshot's checksum of `name`: recorded by start() or the last publish, else computed
        (once, by whoever asks first: an encoder thread)."""

        def get() -> str:
            known = self._sums.get(name)
            if known is None:
                known = self._sums[name] = sb.checksum(self._snapshot[name][2], self.checksum)
            return known

        return get


# ----------------------------------------------------------------------------------- subscriber side


def published_versions(root: Path) -> list[int]:
    """Versions whose index exists (complete publishes), ascending; torn ones are invisible."""
    out = []
    for d in Path(root).glob("weight_v*"):
        if d.is_dir() and d.name[9:].isdigit() and (d / INDEX_NAME).is_file():
            out.append(int(d.name[9:]))
    return sorted(out)


def load_index(root: Path, version: int) -> DeltaIndex:
    path = version_dir(Path(root), version) / INDEX_NAME
    if not path.is_file():
        raise DeltaError(
            f"version {version} is not published under {root} (no {INDEX_NAME}; a torn publish is ignored)"
        )
    try:
        return DeltaIndex.model_validate_json(path.read_bytes())
    except ValueError as e:
        raise CorruptDeltaError(f"{path}: invalid index: {e}") from e


def read_local_state(local: Path) -> LocalState:
    _recover(Path(local))
    path = Path(local) / LOCAL_STATE_NAME
    if not path.is_file():
        raise LineageError(
            f"{local} has no {LOCAL_STATE_NAME}; run init_local (lockstep delta apply does it for version 0)"
        )
    return LocalState.model_validate_json(path.read_bytes())


def init_local(local: Path, root: Path | None = None, version: int = 0) -> LocalState:
    """Materialize a local checkpoint as `version` (0: the baseline) and verify it against ROOT/baseline.json."""
    local = Path(local)
    baseline_path = None if root is None else Path(root) / BASELINE_NAME
    baseline = None
    if baseline_path is not None and baseline_path.is_file():
        baseline = LocalState.model_validate_json(baseline_path.read_bytes())
    algorithm = baseline.checksum_format if baseline is not None else sb.CHECKSUM_FORMAT
    state = {
        e.name: _state_of(e.dtype, e.shape, data, algorithm) for e, data in sb.iter_checkpoint_bytes(local)
    }
    marker = LocalState(version=version, state=state, checksum_format=algorithm)
    if baseline is not None:
        diffs = [
            f"{n}: baseline {baseline.state[n].model_dump()} != local {state[n].model_dump()}"
            for n in sorted(baseline.state.keys() & state.keys())
            if baseline.state[n] != state[n]
        ]
        diffs += [f"{n}: missing locally" for n in sorted(baseline.state.keys() - state.keys())]
        diffs += [f"{n}: not in the baseline" for n in sorted(state.keys() - baseline.state.keys())]
        if baseline.version != version or diffs:
            raise SnapshotMismatchError(
                f"{local} is not byte-identical to the trainer's baseline version {baseline.version}: "
                + "; ".join(diffs[:20])
                + ". Copy the same HF checkpoint to this host."
            )
    sb.write_durable(local / LOCAL_STATE_NAME, marker.model_dump_json().encode())
    return marker


def _recover(local: Path) -> None:
    """Roll a patch forward if a crash interrupted its renames (the temps were verified before)."""
    path = local / JOURNAL_NAME
    if not path.is_file():
        return
    journal = Journal.model_validate_json(path.read_bytes())
    for tmp, final in journal.renames:
        if (local / tmp).exists():
            os.replace(local / tmp, local / final)
    sb.write_durable(local / LOCAL_STATE_NAME, journal.local.model_dump_json().encode())
    path.unlink()
    sb.fsync_dir(local)


@dataclass(slots=True)
class ApplyResult:
    """What one apply_delta call did."""

    from_version: int
    """Local version before."""
    to_version: int
    """Local version after."""
    patched_tensors: int = 0
    """Tensors rewritten, over every applied version."""
    read_bytes: int = 0
    """Compressed delta bytes read from the shared store."""
    versions: list[int] = field(default_factory=list)
    """Versions applied, in order."""


def apply_delta(root: Path, local: Path, version: int | None = None) -> ApplyResult:
    """Patch the local checkpoint up to `version` (default: the latest complete publish), one version
    at a time. Each version is all-or-nothing; a failure raises and leaves the last good version."""
    root, local = Path(root), Path(local)
    current = read_local_state(local)
    available = [v for v in published_versions(root) if v > current.version]
    target = version if version is not None else (available[-1] if available else current.version)
    if target < current.version:
        raise LineageError(f"{local} holds version {current.version}, newer than the requested {target}")
    result = ApplyResult(from_version=current.version, to_version=current.version)
    while current.version < target:
        index = _next_index(root, current.version, target)
        current, patched, read = _apply_one(root, local, current, index)
        result.patched_tensors += patched
        result.read_bytes += read
        result.versions.append(index.version)
        result.to_version = current.version
    return result


def _next_index(root: Path, version: int, target: int) -> DeltaIndex:
    for v in published_versions(root):
        if version < v <= target:
            index = load_index(root, v)
            if index.base_version != version:
                raise LineageError(
                    f"version {v} is based on {index.base_version}, but the local checkpoint holds {version}; "
                    "re-sync the local checkpoint from a full copy"
                )
            return index
    raise LineageError(f"no complete publish after version {version} up to {target} under {root}")


def _decode_tensor(root: Path, index: DeltaIndex, name: str, base: np.ndarray) -> tuple[np.ndarray, int]:
    entry, want = index.tensors[name], index.state[name]
    shard_path = version_dir(root, index.version) / entry.shard
    try:
        shard_entries = {e.name: e for e in sb.file_entries(shard_path)}
    except (OSError, ValueError) as e:
        raise CorruptDeltaError(
            f"delta shard {shard_path} is unreadable ({e}); the publish is damaged"
        ) from e
    if name not in shard_entries:
        raise CorruptDeltaError(f"delta shard {shard_path} lacks tensor {name!r}")
    frame = bytes(sb.read_entry(shard_entries[name]))
    try:
        raw = codec.decompress(frame, entry.raw_bytes)
        out = np.array(base)  # patched copy; the local file is not touched yet
        codec.decode_into(out, raw, index.encoding)
    except codec.CorruptDeltaError as e:
        raise CorruptDeltaError(f"tensor {name!r} of version {index.version}: {e}") from e
    got = sb.checksum(out, index.checksum_format)
    if got != want.checksum:
        raise CorruptDeltaError(
            f"tensor {name!r} of version {index.version}: patched checksum {got} != published {want.checksum}; "
            "the delta or the local base is damaged"
        )
    return out, len(frame)


def _apply_one(
    root: Path, local: Path, current: LocalState, index: DeltaIndex
) -> tuple[LocalState, int, int]:
    entries = sb.checkpoint_entries(local)
    layout_now = {n: (s.dtype, s.shape, s.nbytes) for n, s in current.state.items()}
    layout_new = {n: (s.dtype, s.shape, s.nbytes) for n, s in index.state.items()}
    if layout_now != layout_new:
        diffs = _layout_diffs(layout_now, layout_new)
        raise LineageError(
            f"version {index.version} changes the checkpoint layout ({'; '.join(diffs[:5])}); deltas cannot"
        )
    patched: dict[Path, list[tuple[int, np.ndarray]]] = {}
    read = 0
    for name in sorted(index.tensors):
        e = entries[name]
        base = sb.read_entry(e)
        if sb.checksum(base, index.checksum_format) != index.tensors[name].base_checksum:
            raise LineageError(
                f"local tensor {name!r} does not have the base checksum of version {index.version}; "
                f"{local} drifted from version {current.version}: re-sync it from a full copy"
            )
        new, n = _decode_tensor(root, index, name, base)
        read += n
        patched.setdefault(e.file, []).append((e.offset, new))
    renames: list[tuple[str, str]] = []
    try:
        for path, writes in patched.items():
            tmp = path.with_name(f".{path.name}.v{index.version:06d}.tmp")
            renames.append((tmp.name, path.name))
            shutil.copyfile(path, tmp)
            with open(tmp, "r+b") as f:
                for offset, data in writes:
                    f.seek(offset)
                    f.write(data.tobytes())
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        for tmp_name, _ in renames:
            (local / tmp_name).unlink(missing_ok=True)
        raise
    new_state = LocalState(
        version=index.version, state=dict(index.state), checksum_format=index.checksum_format
    )
    sb.write_durable(
        local / JOURNAL_NAME, Journal(renames=renames, local=new_state).model_dump_json().encode()
    )
    _recover(local)  # from here on the patch is committed: renames + marker, redone after a crash
    return new_state, sum(len(w) for w in patched.values()), read


def verify_root(root: Path) -> list[str]:
    """Problems of a publish root: broken lineage chain, unreadable shards, frames that do not decode.

    Returns an empty list when every complete version is sound; torn (index-less) versions are listed
    as notes since subscribers ignore them.
    """
    root = Path(root)
    problems: list[str] = []
    previous: int | None = None
    if (root / BASELINE_NAME).is_file():
        previous = LocalState.model_validate_json((root / BASELINE_NAME).read_bytes()).version
    for d in sorted(root.glob("weight_v*")):
        if d.is_dir() and not (d / INDEX_NAME).is_file():
            problems.append(f"{d.name}: no {INDEX_NAME} (torn publish, ignored by subscribers)")
    for v in published_versions(root):
        try:
            index = load_index(root, v)
        except DeltaError as e:
            problems.append(str(e))
            continue
        if previous is not None and index.base_version != previous:
            problems.append(
                f"version {v}: based on {index.base_version}, but the previous version is {previous}"
            )
        previous = v
        for name, entry in sorted(index.tensors.items()):
            try:
                shard = {e.name: e for e in sb.file_entries(version_dir(root, v) / entry.shard)}
                codec.decompress(bytes(sb.read_entry(shard[name])), entry.raw_bytes)
            except (OSError, ValueError, KeyError) as e:
                problems.append(f"version {v}: tensor {name!r} in {entry.shard}: {e}")
    return problems


# ------------------------------------------------------------------------------------------ transport

Reload = Callable[[Path, int], None]
"""Engine reload of a patched local checkpoint at a version (pause, /update_weights_from_disk, continue)."""


def http_reload(engine_url: str, *, pause_mode: str = "retract", timeout_s: float = 600.0) -> Reload:
    """A Reload for an engine over HTTP: pause, /update_weights_from_disk at the version, continue.

    This is the only step of the disk-delta path that pauses generation (§7.2.4 step 5). It goes
    through lockstep.serving.EngineClient like every other transport; an engine error is a DeltaError.
    """

    async def install(local: Path, version: int, timer: phases.PhaseTimer | None) -> None:
        async with EngineClient(engine_url, timeout_s=timeout_s, retries=1) as client:
            with phases.charged(timer, "pause"):
                await client.pause_generation(pause_mode)
            try:
                with phases.charged(timer, "engine_load"):
                    await client.update_weights_from_disk(str(local), weight_version=version)
            finally:
                with phases.charged(timer, "resume"):
                    await client.continue_generation()

    def reload(local: Path, version: int) -> None:
        io = LoopThread("disk-delta-reload")  # an update is synchronous; the client is async
        try:
            io.run(install(local, version, phases.current()))
        except EngineError as e:
            raise DeltaError(f"engine reload of {local} at version {version} failed: {e}") from e
        finally:
            io.close()

    return reload


class DiskDeltaTransport:
    """WeightTransport over a shared directory: publish, patch each engine host's copy, then reload.

    `subscribers` are (local checkpoint dir, reload) pairs, one per engine host; in a cluster each
    engine pod runs apply_delta itself and this transport only publishes (no subscribers).
    """

    name = "disk-delta"

    def __init__(
        self,
        publisher: DeltaPublisher,
        subscribers: list[tuple[Path, Reload]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.publisher = publisher
        self.subscribers = subscribers or []
        self.clock = clock

    def first_update(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> TransferReport:
        """Version 0: publish nothing, verify trainer export and every host's copy against the baseline."""
        with phases.measure(self.clock) as timer:
            self.publisher.check_export(named_tensors)
            with phases.phase("encode"):
                result = self.publisher.start()
            with phases.phase("patch"):
                for local, _ in self.subscribers:
                    init_local(local, self.publisher.root, result.version)
        return timer.stamp(TransferReport(version=result.version, transport=self.name))

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> TransferReport:
        with phases.measure(self.clock) as timer:
            result = self.publisher.publish(named_tensors, version)
            # Patch every host before any reload: a damaged delta fails here with no engine touched.
            with phases.phase("patch"):
                for local, _ in self.subscribers:
                    apply_delta(self.publisher.root, local, version)
            for local, reload in self.subscribers:
                reload(local, version)
        report = TransferReport(
            version=version,
            transport=self.name,
            tensors=result.tensors,
            payload_bytes=result.total_bytes,
            wire_bytes=result.wire_bytes,
            extra={
                "update_weights_density": result.density,
                "update_weights_wire_bytes": float(result.wire_bytes),
            },
        )
        return timer.stamp(report)

    def close(self) -> None:
        return None
