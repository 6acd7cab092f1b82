"""Hub dataset ids as spec.data.prompts, offline: a pre-filled huggingface_hub cache resolves (config
and split picked by suffix), `lockstep run` trains on it, a missing dataset fails with exit 2 naming
the dataset and the cache, and `lockstep pull-model --dataset` fills a directory.

The cache is laid out as huggingface_hub writes it (datasets--org--name/{blobs,refs,snapshots}, the
snapshot's files symlinks to content-addressed blobs), holding a GSM8K-shaped repo: a card declaring
two configs and parquet files under one directory per config. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import yaml
from lockstep.cli import main
from lockstep.models import CheckpointError
from lockstep.models.checkpoint import HubRef
from lockstep.models.hub_data import parse_dataset_ref, resolve_prompts
from lockstep.tasks import load_task
from lockstep.tasks.digits import ReverseDigits

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
---
# a GSM8K-shaped dataset for tests
"""
FIXTURE = Path(__file__).parents[1] / "driver" / "fixtures" / "tiny-fast.yaml"


def _repo(root: Path) -> Path:
    """The dataset repo's files: reverse-digit prompts the tiny model can render, `row` for checks."""
    import datasets

    task = ReverseDigits(0)
    for config, split, start in (("main", "train", 0), ("main", "test", 100), ("socratic", "train", 200)):
        rows = [
            {"question": task.item(i).messages[-1]["content"], "answer": task.item(i).answer, "row": i}
            for i in range(start, start + 6)
        ]
        (root / config).mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(rows).to_parquet(str(root / config / f"{split}-00000-of-00001.parquet"))
    (root / "README.md").write_text(CARD)
    return root


def _fill_cache(hf_home: Path, repo_id: str, files: Path) -> Path:
    """`files` (a tree) as snapshot COMMIT of dataset `repo_id` (ref main) under `hf_home`'s hub cache."""
    repo = hf_home / "hub" / ("datasets--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    for f in sorted(p for p in files.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / f.relative_to(files)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


@pytest.fixture()
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HOME with dataset org/gsm8k-like cached, HF_HUB_OFFLINE=1, a token set."""
    home = tmp_path / "hf-home"
    _fill_cache(home, "org/gsm8k-like", _repo(tmp_path / "repo"))
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_never_printed")
    return home


@pytest.mark.parametrize(
    ("source", "parsed"),
    [
        ("org/data", (HubRef("org/data"), "")),
        ("org/data:test", (HubRef("org/data"), ":test")),
        ("openai/gsm8k@main:main:train", (HubRef("openai/gsm8k", "main"), ":main:train")),
        ("builtin:reverse", None),
        ("/data/prompts", None),
        ("data/prompts.jsonl", None),  # a missing file stays a file (its error says so)
        ("org/data:a:b:c", None),
        ("org/data:", None),
        ("a/b/c", None),
    ],
)
def test_dataset_ids_parse(source: str, parsed: tuple[HubRef, str] | None) -> None:
    assert parse_dataset_ref(source) == parsed


def test_a_cached_dataset_resolves_offline_with_its_config_and_split(offline_hub: Path) -> None:
    snap = offline_hub / "hub" / "datasets--org--gsm8k-like" / "snapshots" / COMMIT
    assert resolve_prompts("org/gsm8k-like:main:test") == f"{snap}:main:test"
    assert resolve_prompts(f"org/gsm8k-like@{COMMIT}:socratic:train") == f"{snap}:socratic:train"
    task = load_task(resolve_prompts("org/gsm8k-like:main:test"))
    assert [task.item(i).metadata["row"] for i in range(6)] == list(range(100, 106))
    with pytest.raises(ValueError, match=r"PATH:CONFIG:SPLIT.*main.*socratic"):
        load_task(resolve_prompts("org/gsm8k-like"))  # two configs: the message names them


def test_a_missing_dataset_names_the_dataset_and_the_cache(offline_hub: Path) -> None:
    with pytest.raises(CheckpointError) as err:
        resolve_prompts("org/absent@v2:main:train")
    msg = str(err.value)
    assert msg.startswith("dataset org/absent@v2:") and str(offline_hub / "hub") in msg
    assert (
        "HF_HUB_OFFLINE=1" in msg and "pull-model --dataset" in msg and "hf_secret_never_printed" not in msg
    )


def _job(tmp_path: Path, prompts: str) -> Path:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["data"] = {"prompts": prompts}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_run_trains_on_a_cached_hub_dataset(offline_hub: Path, tmp_path: Path) -> None:
    job = _job(tmp_path, "org/gsm8k-like:main:train")
    args = ["run", str(job), "--run-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "c")]
    assert main([*args, "--steps", "1"]) == 0


def test_run_on_a_missing_dataset_exits_2_naming_it(
    offline_hub: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _job(tmp_path, "org/absent:main:train")
    args = ["run", str(job), "--run-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "c")]
    assert main([*args, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "dataset org/absent" in err and "not in the Hugging Face cache" in err
    assert "hf_secret_never_printed" not in err


def test_pull_model_dataset_copies_the_snapshot(offline_hub: Path, tmp_path: Path) -> None:
    dest = tmp_path / "data-volume"
    assert main(["pull-model", "--dataset", "org/gsm8k-like", "--dest", str(dest)]) == 0
    assert (dest / "README.md").is_file() and not (dest / "main" / "test-00000-of-00001.parquet").is_symlink()
    task = load_task(resolve_prompts(f"{dest}:main:test"))  # the pods read it as a plain directory
    assert task.item(0).metadata["row"] == 100
