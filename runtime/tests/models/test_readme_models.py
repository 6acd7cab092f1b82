"""README's "Your model, your data", run as written: each `model:` block of its YAML goes into a job
that `lockstep validate` accepts and `lockstep run` trains (one step), and its `lockstep pull-model`
line fills a directory the job then runs on.

The local directory is the README's path under a temporary root (a Qwen3-layout fixture copied
there); the hub id resolves offline from a pre-filled huggingface_hub cache under the README's own
repo id and revision. Nothing is downloaded.
"""

from __future__ import annotations

import re
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from lockstep.cli import main
from test_hub import fill_cache

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "runtime" / "tests" / "driver" / "fixtures" / "tiny-fast.yaml"


def _section() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("## Your model, your data", 1)[1].split("\n## ", 1)[0]


def _model_blocks() -> list[dict[str, str]]:
    (block,) = re.findall(r"```yaml\n(.*?)```", _section(), re.S)
    return [doc["model"] for doc in yaml.safe_load_all(block)]


def _job(tmp_path: Path, model: dict[str, str], name: str) -> Path:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["model"] = model
    doc["spec"]["schedule"]["steps"] = 1
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _run(job: Path, tmp_path: Path, name: str) -> int:
    assert main(["validate", str(job)]) == 0
    args = ["run", str(job), "--run-dir", str(tmp_path / name), "--cache-dir", str(tmp_path / "c")]
    code: int = main([*args, "--steps", "1"])
    return code


@pytest.fixture()
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_the_readme_model_blocks_run_as_written(
    tmp_path: Path, offline_hub: Path, hf_checkpoint: Callable[[str], Path]
) -> None:
    local, hub = _model_blocks()
    assert Path(local["checkpoint"]).is_absolute() and "/" in hub["checkpoint"]
    # A directory in HF layout, at the README's path (under a temporary root).
    where = tmp_path / local["checkpoint"].lstrip("/")
    shutil.copytree(hf_checkpoint(local["family"]), where)
    assert _run(_job(tmp_path, {**local, "checkpoint": str(where)}, "local"), tmp_path, "local") == 0
    # A repo id with @revision, from the cache (HF_HUB_OFFLINE=1, as the README's comment says).
    repo, _, revision = hub["checkpoint"].partition("@")
    fill_cache(offline_hub, repo, hf_checkpoint(hub["family"]), refs=(revision or "main",))
    assert _run(_job(tmp_path, hub, "hub"), tmp_path, "hub") == 0


def test_the_readme_pull_model_line_fills_a_directory_the_job_runs_on(
    tmp_path: Path, offline_hub: Path, hf_checkpoint: Callable[[str], Path]
) -> None:
    line = re.findall(r"`(lockstep pull-model [^-`][^`]+)`", _section())[0]  # the model's, not --dataset
    argv = shlex.split(line)[1:]
    repo, dest = argv[1], Path(argv[argv.index("--dest") + 1])
    fill_cache(offline_hub, repo, hf_checkpoint("qwen3"))
    where = tmp_path / str(dest).lstrip("/")
    assert main([*argv[:-1], str(where)]) == 0
    model = {"checkpoint": str(where), "family": "qwen3"}  # "then point the job at the directory"
    assert _run(_job(tmp_path, model, "pulled"), tmp_path, "pulled") == 0
