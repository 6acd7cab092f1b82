"""crdgen: the committed crds/ are current, structural, and carry every rule, default and column."""

from __future__ import annotations

import copy
import functools
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lockstep.api import RULES, RLJobSpec, WeightSyncSpec
from lockstep.api.crdgen import main, render

REPO = Path(__file__).resolve().parents[3]
CRDS = REPO / "crds"


@functools.cache
def _rendered() -> dict[str, dict[str, Any]]:
    return {
        name: yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        for name, text in render().items()
    }


def crd(plural: str) -> dict[str, Any]:
    return copy.deepcopy(_rendered()[f"rl.lockstep.dev_{plural}.yaml"])


def version(plural: str) -> dict[str, Any]:
    v: dict[str, Any] = crd(plural)["spec"]["versions"][0]
    return v


def nodes(schema: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(schema, dict):
        yield path, schema
        for k, v in schema.get("properties", {}).items():
            yield from nodes(v, f"{path}.{k}")
        for key in ("items", "additionalProperties"):
            if isinstance(schema.get(key), dict):
                yield from nodes(schema[key], f"{path}[]")


def test_committed_crds_are_current(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(CRDS), "--check"]) == 0


def test_check_fails_with_a_diff_when_out_of_date(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "crds"
    shutil.copytree(CRDS, out)
    path = out / "rl.lockstep.dev_rljobs.yaml"
    path.write_text(path.read_text().replace("default: 512", "default: 256"))
    assert main(["--out", str(out), "--check"]) == 1
    captured = capsys.readouterr()
    assert "default: 256" in captured.out and "default: 512" in captured.out
    assert "rl.lockstep.dev_rljobs.yaml" in captured.err
    assert main(["--out", str(out)]) == 0
    assert main(["--out", str(out), "--check"]) == 0


@pytest.mark.parametrize("plural", ["rljobs", "rolloutpools", "trainergroups", "weightchannels"])
def test_schema_is_structural(plural: str) -> None:
    schema = version(plural)["schema"]["openAPIV3Schema"]
    for path, node in nodes(schema):
        assert not {"$ref", "$defs", "anyOf", "oneOf", "allOf", "const", "title", "nullable"} & node.keys(), (
            path
        )
        assert node.get("additionalProperties") is not False, path
        assert "type" in node, path
        if path.startswith(".spec") or path.startswith(".status"):
            assert node.get("description") or path.endswith("[]"), f"{plural}{path} has no description"
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path}: bound lists to keep CEL cost low"
        if node.get("type") == "string" and "enum" not in node and "format" not in node and path[:2] == ".s":
            assert "maxLength" in node, f"{path}: bound strings to keep CEL cost low"
    assert version(plural)["subresources"]["status"] == {}


def test_seed_defaults_are_in_the_crd() -> None:
    spec = version("rljobs")["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    mismatch = spec["algorithm"]["properties"]["mismatch"]["properties"]
    assert (mismatch["low"]["default"], mismatch["high"]["default"]) == (0.0, 2.0)
    ws = spec["weightSync"]["properties"]
    assert ws["bucketMiB"]["default"] == 512
    assert ws["diskDelta"]["properties"]["zstdLevel"]["default"] == 1
    assert ws["diskDelta"]["properties"]["encoding"]["default"] == "xor"
    assert spec["rollout"]["properties"]["session"]["properties"]["matcher"]["default"] == "strict"
    assert "default" not in spec["schedule"]["properties"]["maxWeightStaleness"]
    # a section's default is the whole section, as pydantic builds it (the apiserver checks CEL on it)
    assert ws["diskDelta"]["default"] == WeightSyncSpec().disk_delta.wire()
    assert (
        spec["rollout"]["default"]
        == RLJobSpec.model_fields["rollout"].get_default(call_default_factory=True).wire()
    )


def test_every_rule_sits_where_its_scope_is() -> None:
    cel = set()
    for plural in ("rljobs", "rolloutpools", "trainergroups", "weightchannels"):
        for _, node in nodes(version(plural)["schema"]["openAPIV3Schema"]):
            cel |= {v["rule"] for v in node.get("x-kubernetes-validations", [])}
            for v in node.get("x-kubernetes-validations", []):
                assert ": " in v["message"], "every message names the fix after a colon"
    assert {r.expr.to_cel() for r in RULES} <= cel
    spec = version("rljobs")["schema"]["openAPIV3Schema"]["properties"]["spec"]
    names = [v["message"] for v in spec["x-kubernetes-validations"]]
    assert any(m.startswith("fully-async needs separate GPUs") for m in names)
    assert {v["fieldPath"] for v in spec["x-kubernetes-validations"]} >= {
        ".schedule.colocate",
        ".weightSync.transport",
    }


def test_scale_subresource_and_columns() -> None:
    pool = version("rolloutpools")
    assert pool["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert (
        pool["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["selector"]["type"]
        == "string"
    )
    assert [c["name"] for c in pool["additionalPrinterColumns"] if not c.get("priority")] == [
        "Desired",
        "Ready",
        "Version",
        "Age",
    ]
    job = version("rljobs")["additionalPrinterColumns"]
    assert [c["name"] for c in job if not c.get("priority")] == [
        "Phase",
        "Step",
        "Version",
        "Reward",
        "Staleness",
        "Transport",
        "Age",
    ]
    assert [c["name"] for c in job if c.get("priority") == 1] == ["Queue", "Restarts"]
    names = {
        crd(p)["spec"]["names"]["kind"]: crd(p)["spec"]["names"]["shortNames"]
        for p in ("rljobs", "rolloutpools", "trainergroups", "weightchannels")
    }
    assert names == {
        "RLJob": ["rlj"],
        "RolloutPool": ["rpool", "rp"],
        "TrainerGroup": ["tg"],
        "WeightChannel": ["wch"],
    }


def test_conditions_are_a_map_keyed_by_type() -> None:
    status = version("rljobs")["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    cond = status["conditions"]
    assert (cond["x-kubernetes-list-type"], cond["x-kubernetes-list-map-keys"]) == ("map", ["type"])
    item = cond["items"]
    assert set(item["required"]) == {"type", "status", "reason", "lastTransitionTime"}
    assert item["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert item["properties"]["lastTransitionTime"]["format"] == "date-time"
    assert "observedGeneration" in item["properties"]


def test_keywords_the_apiserver_refuses_fail_generation() -> None:
    from lockstep.api.crdgen import _Inliner

    with pytest.raises(ValueError, match=r"\['propertyNames'\] are not allowed"):
        _Inliner({}, {}).convert({"type": "object", "propertyNames": {"maxLength": 3}})
