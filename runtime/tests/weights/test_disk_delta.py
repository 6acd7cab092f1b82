"""Disk-delta transport end to end on real safetensors files (lockstep.weights.disk_delta, §7.2.4)."""

from __future__ import annotations

import os
from pathlib import Path

import lockstep.models.st_bytes as sb
import lockstep.weights.disk_delta as dd
import pytest
import torch
from lockstep.cli import main as cli
from lockstep.weights.delta_codec import Encoding
from safetensors.torch import load_file, save_file


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 48, generator=g).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.ones(32),
        "lm_head.weight": torch.randn(64, 32, generator=g).bfloat16(),
    }


def step(sd: dict[str, torch.Tensor], seed: int, frac: float = 0.01) -> dict[str, torch.Tensor]:
    """A fake optimizer step: perturb `frac` of the elements of the bf16 tensors."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, x in sd.items():
        y = x.clone()
        if x.dtype == torch.bfloat16:
            mask = torch.rand(x.shape, generator=g) < frac
            y[mask] = (y.float()[mask] * 1.01 + 1e-3).bfloat16()
        out[name] = y
    return out


def write_ckpt(directory: Path, sd: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(sd)
    save_file({n: sd[n] for n in names[:2]}, directory / "model-00001-of-00002.safetensors")
    save_file({n: sd[n] for n in names[2:]}, directory / "model-00002-of-00002.safetensors")
    return directory


def files_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.safetensors"))}


def published_once(tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """(v0, root): a publisher started from v0 under tmp_path/root that published version 1."""
    v0 = model()
    root = tmp_path / "root"
    pub = dd.DeltaPublisher(root, write_ckpt(tmp_path / "base", v0))
    pub.start()
    pub.publish(step(v0, 1).items(), 1)
    return v0, root


def loaded(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in directory.glob("*.safetensors"):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_three_versions_patch_exactly(tmp_path: Path, encoding: Encoding) -> None:
    v0 = model()
    base = write_ckpt(tmp_path / "base", v0)
    local = write_ckpt(tmp_path / "local", v0)
    root = tmp_path / "root"
    reloads: list[tuple[Path, int]] = []
    transport = dd.DiskDeltaTransport(
        dd.DeltaPublisher(root, base, encoding=encoding), [(local, lambda p, v: reloads.append((p, v)))]
    )
    first = transport.first_update(v0.items())
    assert first.version == 0 and dd.published_versions(root) == []  # the first update publishes nothing
    assert dd.read_local_state(local).version == 0
    current = v0
    for version in (1, 2, 3):
        current = step(current, seed=version)
        report = transport.update_weights(current.items(), version)
        assert reloads[-1] == (local, version)
        got = loaded(local)
        assert all(torch.equal(got[n], current[n]) for n in current)
        assert 0 < report.extra["update_weights_density"] < 0.05
        assert report.wire_bytes < report.payload_bytes / 5
    assert dd.read_local_state(local).version == 3
    assert dd.verify_root(root) == []
    # A late subscriber catches up over the whole chain in one call.
    late = write_ckpt(tmp_path / "late", v0)
    dd.init_local(late, root)
    assert dd.apply_delta(root, late).versions == [1, 2, 3]
    assert files_bytes(late) == files_bytes(local)


def test_unchanged_tensors_are_left_out(tmp_path: Path) -> None:
    v0 = model()
    pub = dd.DeltaPublisher(tmp_path / "root", write_ckpt(tmp_path / "base", v0))
    v1 = dict(v0)
    v1["lm_head.weight"] = v0["lm_head.weight"].clone()
    v1["lm_head.weight"][0, 0] += 1
    result = pub.publish(v1.items(), 1)
    index = dd.load_index(tmp_path / "root", 1)
    assert list(index.tensors) == ["lm_head.weight"] and result.changed_tensors == 1
    assert set(index.state) == set(v0) and index.base_version == 0
    assert index.checksum_format == "xxh3-128" and index.compression == "zstd" and index.encoding == "xor"


def test_export_layout_mismatch_fails_before_training(tmp_path: Path) -> None:
    v0 = model()
    pub = dd.DeltaPublisher(tmp_path / "root", write_ckpt(tmp_path / "base", v0))
    bad = dict(v0)
    bad["lm_head.weight"] = v0["lm_head.weight"].float()
    del bad["model.embed_tokens.weight"]
    with pytest.raises(dd.SnapshotMismatchError) as e:
        pub.check_export(bad.items())
    assert "lm_head.weight" in str(e.value) and "model.embed_tokens.weight: missing" in str(e.value)


def test_engine_copy_differs_from_baseline(tmp_path: Path) -> None:
    v0 = model()
    pub = dd.DeltaPublisher(tmp_path / "root", write_ckpt(tmp_path / "base", v0))
    pub.start()
    other = write_ckpt(tmp_path / "local", step(v0, seed=9))
    with pytest.raises(dd.SnapshotMismatchError, match="not byte-identical"):
        dd.init_local(other, tmp_path / "root")


def test_replica_mismatch_fails_before_any_reload(tmp_path: Path) -> None:
    v0 = model()
    local = write_ckpt(tmp_path / "local", v0)
    reloads: list[int] = []
    transport = dd.DiskDeltaTransport(
        dd.DeltaPublisher(tmp_path / "root", write_ckpt(tmp_path / "base", v0)),
        [(local, lambda p, v: reloads.append(v))],
    )
    transport.first_update(v0.items())
    v1 = step(v0, 1)
    stage2_copy = v1["lm_head.weight"].clone()
    stage2_copy[0, 0] += 1  # the second pipeline stage holds a diverged replica
    with pytest.raises(dd.ReplicaMismatchError, match=r"lm_head\.weight"):
        transport.update_weights([*v1.items(), ("lm_head.weight", stage2_copy)], 1)
    assert reloads == [] and dd.published_versions(tmp_path / "root") == []
    assert not dd.version_dir(tmp_path / "root", 1).exists()


def test_torn_publish_is_never_picked_up(tmp_path: Path) -> None:
    v0, root = published_once(tmp_path)
    local = write_ckpt(tmp_path / "local", v0)
    dd.init_local(local, root)
    # Index missing: the version is invisible, apply stays at version 0.
    index = dd.version_dir(root, 1) / dd.INDEX_NAME
    saved = index.read_bytes()
    index.unlink()
    assert dd.published_versions(root) == []
    assert dd.apply_delta(root, local).to_version == 0
    assert any("torn publish" in p for p in dd.verify_root(root))
    # Partial shard under a present index: rejected, local unchanged.
    index.write_bytes(saved)
    shard = next(dd.version_dir(root, 1).glob("delta-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = files_bytes(local)
    with pytest.raises(dd.CorruptDeltaError):
        dd.apply_delta(root, local)
    assert files_bytes(local) == before and dd.read_local_state(local).version == 0
    assert not [p for p in os.listdir(local) if p.endswith(".tmp")]


def test_corrupted_delta_rejected_by_patched_checksum(tmp_path: Path) -> None:
    v0, root = published_once(tmp_path)
    # Damage one target checksum: the delta itself decodes fine, the PATCHED tensor is wrong.
    path = dd.version_dir(root, 1) / dd.INDEX_NAME
    index = dd.DeltaIndex.model_validate_json(path.read_bytes())
    name = sorted(index.tensors)[0]
    index.state[name].checksum = "0" * 32
    path.write_text(index.model_dump_json())
    local = write_ckpt(tmp_path / "local", v0)
    dd.init_local(local, root)
    before = files_bytes(local)
    with pytest.raises(dd.CorruptDeltaError, match="patched checksum"):
        dd.apply_delta(root, local)
    assert files_bytes(local) == before


def test_lineage_xor_never_applied_twice(tmp_path: Path) -> None:
    v0, root = published_once(tmp_path)
    local = write_ckpt(tmp_path / "local", v0)
    dd.init_local(local, root)
    dd.apply_delta(root, local, 1)
    # Someone resets the marker to version 0: the local bytes no longer match the base checksums.
    dd.init_local(local, None, 0)
    before = files_bytes(local)
    with pytest.raises(dd.LineageError, match="drifted"):
        dd.apply_delta(root, local, 1)
    assert files_bytes(local) == before


def test_crash_after_journal_rolls_forward(tmp_path: Path) -> None:
    v0 = model()
    root = tmp_path / "root"
    pub = dd.DeltaPublisher(root, write_ckpt(tmp_path / "base", v0))
    pub.start()
    v1 = step(v0, 1)
    pub.publish(v1.items(), 1)
    local = write_ckpt(tmp_path / "local", v0)
    dd.init_local(local, root)
    # Simulate a crash between the journal and the renames: write the journal by hand.
    index = dd.load_index(root, 1)
    entries = sb.checkpoint_entries(local)
    renames = []
    for f in sorted({entries[n].file for n in index.tensors}):
        tmp = f.with_name(f".{f.name}.v000001.tmp")
        names = [n for n in index.tensors if entries[n].file == f]
        save_file({n: v1[n] if n in names else t for n, t in load_file(f).items()}, tmp)
        renames.append((tmp.name, f.name))
    journal = dd.Journal(renames=renames, local=dd.LocalState(version=1, state=dict(index.state)))
    (local / dd.JOURNAL_NAME).write_text(journal.model_dump_json())
    assert dd.read_local_state(local).version == 1  # recovery completes the swap
    got = loaded(local)
    assert all(torch.equal(got[n], v1[n]) for n in v1)


def test_cli_publish_apply_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    v0 = model()
    v1 = step(v0, 1)
    base, new = write_ckpt(tmp_path / "v0", v0), write_ckpt(tmp_path / "v1", v1)
    local = write_ckpt(tmp_path / "local", v0)
    root = tmp_path / "root"
    assert (
        cli(
            [
                "delta",
                "publish",
                "--base",
                str(base),
                "--new",
                str(new),
                "--root",
                str(root),
                "--encoding",
                "overwrite",
                "--checksum",
                "blake3",
            ]
        )
        == 0
    )
    assert "published version 1" in capsys.readouterr().out
    assert dd.load_index(root, 1).checksum_format == "blake3"
    assert cli(["delta", "verify", "--root", str(root)]) == 0
    # Version 2 diffed against the wrong base (v0 instead of v1) is refused before anything is written.
    v2 = write_ckpt(tmp_path / "v2", step(v1, 2))
    assert cli(["delta", "publish", "--base", str(base), "--new", str(v2), "--root", str(root)]) == 1
    assert "base snapshot is not version 1" in capsys.readouterr().err
    assert dd.published_versions(root) == [1]
    assert cli(["delta", "apply", "--root", str(root), "--local", str(local)]) == 0
    assert files_bytes(local) == files_bytes(new)
    # Failures: a second local copy that differs from the baseline, and a damaged shard.
    other = write_ckpt(tmp_path / "other", step(v0, 7))
    before = files_bytes(other)
    assert cli(["delta", "apply", "--root", str(root), "--local", str(other)]) == 1
    assert "not byte-identical" in capsys.readouterr().err
    assert files_bytes(other) == before
    shard = next(dd.version_dir(root, 1).glob("delta-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-7])
    assert cli(["delta", "verify", "--root", str(root)]) == 1
    fresh = write_ckpt(tmp_path / "fresh", v0)
    assert cli(["delta", "apply", "--root", str(root), "--local", str(fresh)]) == 1
    assert files_bytes(fresh) == files_bytes(base)
    assert cli(["delta", "verify", "--root", str(tmp_path / "nope")]) == 1


def test_checksum_algorithms_known_answers() -> None:
    # Reference digests of b"abc": RFC 1950 adler32 and the BLAKE3 paper's test vector.
    assert sb.checksum(b"abc", "adler32") == "024d0127"
    assert sb.checksum(b"abc", "blake3") == "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
    assert len(sb.checksum(b"abc")) == 32  # xxh3-128 by default
    with pytest.raises(ValueError, match="checksum must be one of"):
        sb.checksum(b"abc", "md5")


@pytest.mark.parametrize("algorithm", ["blake3", "adler32"])
def test_publisher_checksum_choice_is_followed_by_subscribers(
    tmp_path: Path, algorithm: sb.ChecksumAlgorithm
) -> None:
    v0 = model()
    root = tmp_path / "root"
    pub = dd.DeltaPublisher(root, write_ckpt(tmp_path / "base", v0), checksum=algorithm)
    pub.start()
    v1 = step(v0, 1)
    pub.publish(v1.items(), 1)
    index = dd.load_index(root, 1)
    assert index.checksum_format == algorithm
    name = sorted(index.tensors)[0]
    assert index.state[name].checksum == sb.checksum(sb.tensor_bytes(v1[name]), algorithm)
    local = write_ckpt(tmp_path / "local", v0)
    assert dd.init_local(local, root).checksum_format == algorithm
    dd.apply_delta(root, local)
    got = loaded(local)
    assert all(torch.equal(got[n], v1[n]) for n in v1)
    assert dd.read_local_state(local).checksum_format == algorithm
    # The algorithm is really used: a damaged target checksum in that format is caught.
    index.state[name].checksum = "0" * len(index.state[name].checksum)
    (dd.version_dir(root, 1) / dd.INDEX_NAME).write_text(index.model_dump_json())
    other = write_ckpt(tmp_path / "other", v0)
    dd.init_local(other, root)
    with pytest.raises(dd.CorruptDeltaError, match="patched checksum"):
        dd.apply_delta(root, other)
