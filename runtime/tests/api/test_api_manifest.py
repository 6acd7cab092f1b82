"""load_manifest / load_objects edge cases: text vs path, YAML errors, kinds, several documents, stdin."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.api import ManifestError, RolloutPool, load_manifest, load_objects
from lockstep.cli import main

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TINY = (EXAMPLES / "tiny-local.yaml").read_text()


def test_a_missing_file_is_not_parsed_as_yaml() -> None:
    with pytest.raises(FileNotFoundError):
        load_manifest("examples/no-such-job.yaml")


def test_invalid_yaml_is_one_problem() -> None:
    with pytest.raises(ManifestError, match=r"^\(yaml\): null: not valid YAML: ") as err:
        load_manifest("spec: [unclosed\n")
    assert len(str(err.value).splitlines()) == 1


def test_unknown_kind_and_empty_manifest() -> None:
    with pytest.raises(ManifestError, match=r'^kind: "Job": must be one of RLJob, RolloutPool, TrainerGroup'):
        load_manifest("apiVersion: batch/v1\nkind: Job\n")
    with pytest.raises(ManifestError, match="the manifest is empty"):
        load_manifest("# nothing\n")


def test_wrong_api_version_names_the_right_one() -> None:
    with pytest.raises(
        ManifestError,
        match=r'^apiVersion: "rl.lockstep.dev/v1": Input should be \'rl.lockstep.dev/v1alpha1\'',
    ):
        load_manifest(TINY.replace("rl.lockstep.dev/v1alpha1", "rl.lockstep.dev/v1"))


def test_several_documents_are_indexed() -> None:
    pool: dict[str, Any] = {
        "apiVersion": "rl.lockstep.dev/v1alpha1",
        "kind": "RolloutPool",
        "metadata": {"name": "p"},
        "spec": {"job": "tiny-local", "model": {"checkpoint": "builtin:tiny", "family": "tiny"}},
    }
    text = TINY + "\n---\n" + yaml.safe_dump(pool)
    objects = load_objects(text)
    assert [type(o).__name__ for o in objects] == ["RLJob", "RolloutPool"]
    assert load_manifest(text).metadata.name == "tiny-local"
    bad = TINY + "\n---\n" + yaml.safe_dump({**pool, "spec": {**pool["spec"], "replicas": -1}})
    with pytest.raises(
        ManifestError, match=r"^\[1\]\.spec\.replicas: -1: Input should be greater than or equal to 0"
    ):
        load_objects(bad)
    assert isinstance(objects[1], RolloutPool)
    with pytest.raises(ManifestError, match="expected exactly one RLJob, found 2"):
        load_manifest(TINY + "\n---\n" + TINY)


def test_validate_reads_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load(TINY)
    doc["spec"]["schedule"]["steps"] = 0  # edit the parsed example: its tuned values change over time
    monkeypatch.setattr("sys.stdin", io.StringIO(yaml.safe_dump(doc)))
    assert main(["validate", "-"]) == 1
    assert capsys.readouterr().out.strip() == (
        "-: spec.schedule.steps: 0: Input should be greater than or equal to 1"
    )


def test_show_defaults_prints_the_filled_in_object(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--show-defaults", str(EXAMPLES / "tiny-local.yaml")]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["spec"]["weightSync"]["bucketMiB"] == 512
    # The API's defaults (TIS with bounds [0, 2], §4.2) overlaid by whatever the example states.
    given = yaml.safe_load((EXAMPLES / "tiny-local.yaml").read_text())["spec"]["algorithm"].get(
        "mismatch", {}
    )
    assert shown["spec"]["algorithm"]["mismatch"] == {"correction": "tis", "low": 0.0, "high": 2.0, **given}
    assert load_manifest(yaml.safe_dump(shown)) == load_manifest(EXAMPLES / "tiny-local.yaml")
