"""The cross-field rules and the bad-manifest table, through the real `lockstep validate` command.

Every row of bad_manifests.yaml must be refused with its path and message, every example must pass,
every rule of lockstep.api.rules must be exercised by some row, and the transition rules (immutable
model and backend) must refuse updates.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml
from api_bad_manifests import EXAMPLES, example, load_table, random_manifest
from lockstep.api import RULES, ManifestError, check_update, load_manifest, parse_object
from lockstep.cli import main

TABLE = load_table()


def run_validate(capsys: pytest.CaptureFixture[str], *paths: Path) -> tuple[int, list[str]]:
    code = main(["validate", *map(str, paths)])
    out = capsys.readouterr().out
    return code, [line for line in out.splitlines() if line]


def test_table_is_big_enough_and_names_are_unique() -> None:
    assert len(TABLE) >= 25
    assert len({row.name for row in TABLE}) == len(TABLE)


@pytest.mark.parametrize("row", TABLE, ids=[r.name for r in TABLE])
def test_bad_manifest_is_refused_with_its_message(
    row: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from api_bad_manifests import BadManifest

    assert isinstance(row, BadManifest)
    path = tmp_path / f"{row.name}.yaml"
    path.write_text(yaml.safe_dump(row.manifest))
    code, lines = run_validate(capsys, path)
    assert code == 1
    wanted = [line for line in lines if line.startswith(f"{path}: {row.path}: ")]
    assert wanted, f"no problem at {row.path}; got {lines}"
    assert any(row.message in line for line in wanted), lines


def test_every_rule_is_exercised_by_the_table() -> None:
    fired: set[str] = set()
    for row in TABLE:
        with pytest.raises(ManifestError) as err:
            parse_object(row.manifest)
        fired |= {p.message for p in err.value.problems}
    untested = [r.name for r in RULES if not r.transition and r.message not in fired]
    # the pool's own bound rule sits on RolloutPool and is tested below
    assert untested == ["pool-replicas-within-autoscaling"]


def test_every_unbuilt_feature_has_its_own_row() -> None:
    # each `*-not-built` rule is refused alone by validate and by the apiserver (e2e/test_api_crds.py)
    unbuilt = {r.name for r in RULES if r.name.endswith("-not-built")}
    assert len(unbuilt) >= 5
    rows = {row.name: row for row in TABLE}
    for name in sorted(unbuilt):
        rule = next(r for r in RULES if r.name == name)
        with pytest.raises(ManifestError) as err:
            parse_object(rows[name].manifest)
        assert [p.message for p in err.value.problems] == [rule.message], name


def test_examples_validate(capsys: pytest.CaptureFixture[str]) -> None:
    paths = sorted(EXAMPLES.glob("*.yaml"))
    assert {p.stem for p in paths} >= {"tiny-local", "h100", "glm5-gb300"}
    code, lines = run_validate(capsys, *paths)
    assert (code, lines) == (0, [])


def test_several_files_each_line_prefixed_by_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump(example("tiny-local")))
    doc = example("glm5-gb300")
    doc["spec"]["schedule"]["colocate"] = True
    doc["spec"]["rollout"]["precision"] = "nvfp4"
    bad.write_text(yaml.safe_dump(doc))
    code, lines = run_validate(capsys, good, bad)
    assert code == 1
    assert len(lines) == 2 and all(line.startswith(f"{bad}: spec.") for line in lines)
    assert f"{bad}: spec.schedule.colocate: true: fully-async needs separate GPUs" in lines[0] + lines[1]


def test_unreadable_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["validate", str(tmp_path / "missing.yaml")])
    assert code == 2
    assert "cannot read" in capsys.readouterr().err


def test_manifest_error_is_one_line_per_problem() -> None:
    doc = example("glm5-gb300")
    doc["spec"]["schedule"]["colocate"] = True
    doc["spec"]["trainer"]["backend"] = "megatron"
    with pytest.raises(ManifestError) as err:
        load_manifest(yaml.safe_dump(doc))
    lines = str(err.value).splitlines()
    assert lines == [
        "spec.schedule.colocate: true: fully-async needs separate GPUs for rollout and training: set "
        "schedule.colocate to false or schedule.mode to sync",
        'spec.model.family: "glm47": the megatron backend builds the Qwen3 and Qwen3-MoE architectures only '
        "(families tiny, qwen3); GLM's MLA/DSA attention is not built in it (docs/megatron.md): set "
        "trainer.backend to fsdp, which builds every family through transformers",
    ]


def test_the_gb300_example_is_a_job_that_runs() -> None:
    """§9's GLM-5 on megatron is refused at apply naming the fix; the example is what runs: a GLM
    on the fsdp backend (data parallel over the 32 trainer GPUs), FP8 serving over broadcast."""
    job = load_manifest(EXAMPLES / "glm5-gb300.yaml")
    t = job.spec.trainer
    assert (t.backend, t.nodes * t.gpus_per_node, job.spec.model.family) == ("fsdp", 32, "glm47")
    assert (job.spec.rollout.precision, job.spec.weight_sync.transport) == ("fp8", "broadcast")
    seed = example("glm5-gb300")
    seed["spec"]["model"].update(checkpoint="/models/glm-5.2", family="glm5", variant="744b-a40b")
    seed["spec"]["trainer"].update(backend="megatron", parallelism={"tensor": 2, "pipeline": 4, "expert": 8})
    with pytest.raises(
        ManifestError, match=r"spec\.model\.family: \"glm5\": the megatron backend builds"
    ) as err:
        load_manifest(yaml.safe_dump(seed))
    assert "set trainer.backend to fsdp" in str(err.value)


def _pool(replicas: int, low: int, high: int) -> dict[str, object]:
    return {
        "apiVersion": "rl.lockstep.dev/v1alpha1",
        "kind": "RolloutPool",
        "metadata": {"name": "pool"},
        "spec": {
            "job": "j",
            "replicas": replicas,
            "autoscaling": {"minReplicas": low, "maxReplicas": high},
            "model": {"checkpoint": "builtin:tiny", "family": "tiny"},
        },
    }


def test_pool_replicas_within_bounds() -> None:
    parse_object(_pool(3, 1, 4))
    with pytest.raises(ManifestError, match=r"^spec.replicas: 5: replicas must lie within"):
        parse_object(_pool(5, 1, 4))


def test_changing_model_or_backend_is_refused_on_update() -> None:
    before = load_manifest(EXAMPLES / "glm5-gb300.yaml")
    after = before.model_copy(deep=True)
    after.spec.model.checkpoint = "/models/other"
    after.spec.trainer.backend = after.spec.trainer.backend.MEGATRON
    problems = [str(p) for p in check_update(before, after)]
    assert problems == [
        'spec.model.checkpoint: "/models/other": the model cannot change after creation: create a new job',
        'spec.trainer.backend: "megatron": the trainer backend cannot change after creation: create a new job',
    ]
    same = before.model_copy(deep=True)
    same.spec.schedule.steps = 5
    assert check_update(before, same) == []


def test_docs_list_every_rule_with_its_message() -> None:
    docs = (EXAMPLES.parent / "docs" / "api.md").read_text()
    missing = [r.name for r in RULES if f"`{r.name}`" not in docs or r.message not in docs]
    assert missing == [], "update the rules table of docs/api.md"


def test_random_manifests_evaluate_without_rule_bugs() -> None:
    # every rule guards what may be absent: no RuleBug, only ManifestError or success
    rng = random.Random(7)
    outcomes = {"valid": 0, "refused": 0}
    for i in range(300):
        try:
            parse_object(random_manifest(rng, f"r{i}"))
            outcomes["valid"] += 1
        except ManifestError as err:
            assert all(p.message for p in err.problems)
            outcomes["refused"] += 1
    assert outcomes["valid"] > 0 and outcomes["refused"] > 0, outcomes


def test_the_session_families_of_the_agent_rule_are_the_registered_ones() -> None:
    """The rule agent-needs-a-session-family names exactly the families the session server knows."""
    from lockstep.api.rules import SESSION_FAMILIES
    from lockstep.models.families import names

    assert list(SESSION_FAMILIES) == names()
