"""Hugging Face repo ids as model references, offline: a pre-filled huggingface_hub cache resolves, a
missing repo fails with exit 2 naming the repo and the cache, and `lockstep pull-model` (the command
the operator's init step runs) fills a directory.

The cache is laid out as huggingface_hub writes it (models--org--name/{blobs,refs,snapshots}, the
snapshot's files symlinks to content-addressed blobs); nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from lockstep.cli import main
from lockstep.models import ChatTokenizer, CheckpointError, resolve_checkpoint
from lockstep.models.checkpoint import HubRef, parse_hub_ref

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fill_cache(hf_home: Path, repo_id: str, model_dir: Path, refs: tuple[str, ...] = ("main",)) -> Path:
    """Put `model_dir`'s files into the hub cache under `hf_home` as snapshot COMMIT of `repo_id`."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in model_dir.iterdir():
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    for ref in refs:
        (repo / "refs" / ref).write_text(COMMIT)
    return snap


@pytest.fixture()
def offline_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hf_checkpoint: Callable[[str], Path]
) -> Path:
    """HF_HOME with org/tiny-qwen3 cached (main and tag v1), HF_HUB_OFFLINE=1, a token set."""
    home = tmp_path / "hf-home"
    fill_cache(home, "org/tiny-qwen3", hf_checkpoint("qwen3"), refs=("main", "v1"))
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_never_printed")
    return home


def test_repo_ids_parse_with_an_optional_revision() -> None:
    assert parse_hub_ref("Qwen/Qwen3-4B") == HubRef("Qwen/Qwen3-4B")
    assert parse_hub_ref("org/name@v1.0") == HubRef("org/name", "v1.0")
    assert parse_hub_ref("org/name@refs/pr/1") == HubRef("org/name", "refs/pr/1")
    for not_a_repo in ("/models/qwen", "./org/name", "name", "a/b/c", "org/../x", "org/name@"):
        assert parse_hub_ref(not_a_repo) is None, not_a_repo


def test_a_cached_repo_resolves_offline_at_a_branch_a_tag_or_a_commit(offline_hub: Path) -> None:
    for ref in ("org/tiny-qwen3", "org/tiny-qwen3@v1", f"org/tiny-qwen3@{COMMIT}"):
        path = resolve_checkpoint(ref)
        assert path == offline_hub / "hub" / "models--org--tiny-qwen3" / "snapshots" / COMMIT, ref
    tok = ChatTokenizer.load(resolve_checkpoint("org/tiny-qwen3"))
    assert tok.render_text([{"role": "user", "content": "hi"}], True).startswith("<|im_start|>user\nhi")


def test_a_missing_repo_names_the_repo_and_the_cache(offline_hub: Path) -> None:
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint("org/absent@v2")
    msg = str(err.value)
    assert "org/absent@v2" in msg and str(offline_hub / "hub") in msg and "HF_HUB_OFFLINE=1" in msg
    assert "lockstep pull-model" in msg and "hf_secret_never_printed" not in msg


def test_pull_model_copies_a_cached_snapshot_into_dest(
    offline_hub: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "model-volume"
    assert main(["pull-model", "org/tiny-qwen3@v1", "--dest", str(dest)]) == 0
    assert f"pulled org/tiny-qwen3@v1 into {dest}" in capsys.readouterr().out
    assert (dest / "config.json").is_file() and not (dest / "config.json").is_symlink()
    assert resolve_checkpoint(str(dest)) == dest  # the pods read it as a plain directory


def test_pull_model_exits_2_naming_the_repo(
    offline_hub: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["pull-model", "org/absent", "--dest", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "org/absent" in err and "hf_secret_never_printed" not in err
    assert main(["pull-model", "not a repo", "--dest", str(tmp_path / "d")]) == 2
    assert "not a Hugging Face repo id" in capsys.readouterr().err


def test_run_on_a_missing_repo_exits_2_naming_it(
    offline_hub: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = yaml.safe_load((Path(__file__).parents[1] / "driver" / "fixtures" / "tiny-fast.yaml").read_text())
    doc["spec"]["model"] = {"checkpoint": "org/absent", "family": "qwen3"}
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    assert main(["run", str(manifest), "--run-dir", str(tmp_path / "run"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "org/absent" in err and "not in the Hugging Face cache" in err
    assert "hf_secret_never_printed" not in err


def test_an_unreachable_endpoint_names_the_repo_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Online mode against an endpoint that refuses connections (HF_ENDPOINT): no cache, a clear error."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connecting is refused
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint("org/elsewhere")
    assert "org/elsewhere" in str(err.value) and "HF_ENDPOINT" in str(err.value)
