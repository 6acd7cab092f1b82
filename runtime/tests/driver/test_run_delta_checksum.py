"""spec.weightSync.diskDelta.checksum reaches the publisher: a `lockstep run` with blake3 publishes
indexes in blake3 and the engine's copy is patched and verified with it."""

from __future__ import annotations

from pathlib import Path

import lockstep.weights.disk_delta as dd
import yaml
from lockstep.cli import main

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-fast.yaml"


def test_run_publishes_with_the_manifest_checksum(tmp_path: Path) -> None:
    doc = yaml.safe_load(FIXTURE.read_text())
    doc["spec"]["weightSync"] = {"transport": "disk-delta", "diskDelta": {"checksum": "blake3"}}
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    args = ["run", str(manifest), "--run-dir", str(run_dir), "--cache-dir", str(tmp_path / "cache")]
    assert main([*args, "--steps", "1"]) == 0
    root = run_dir / "delta"
    assert dd.published_versions(root) == [1]
    assert dd.load_index(root, 1).checksum_format == "blake3"
    (copy,) = (run_dir / "engine-copies").iterdir()
    local = dd.read_local_state(copy)
    assert (local.version, local.checksum_format) == (1, "blake3")
