"""No silent success: a run that cannot train says so (lockstep.driver.batch_checks).

End to end through `lockstep run` on the tiny model (a real engine on 127.0.0.1, the FSDP trainer):
an agent that raises on every trajectory used to print "done", exit 0 and train nothing; now the first
step stops the run with exit 6 naming the agent's error, and no step is trained. An agent whose
samples carry no trainable token runs, and after ZERO_TOKEN_STEPS steps the progress document says
Degraded with the reason (the operator turns it into the job's Degraded condition). The BatchWatch
table covers recovery and the reward bound without an engine.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from lockstep.api import load_manifest
from lockstep.cli import main
from lockstep.driver.batch_checks import ZERO_TOKEN_STEPS, BatchWatch
from lockstep.driver.loop import run
from lockstep.driver.settings import RunOptions
from lockstep.observability.metrics import read_jsonl
from lockstep.progress import DriverProgress, NullReporter
from lockstep.rollout.async_worker import RolloutFailed
from lockstep.tasks.shell.rows import SANDBOX_KEY
from lockstep.trainer.protocol import NonFiniteLoss
from lockstep.types import Group, Sample, SampleStatus

pytestmark = pytest.mark.heavy

EXAMPLE = Path(__file__).parents[3] / "examples" / "tiny-tools.yaml"
AGENTS = """
    from lockstep.types import SampleStatus

    async def always_fails(ctx, sample):
        raise RuntimeError("the sandbox refused to start: no shell in the image")

    async def trains_nothing(ctx, sample):
        sample = await ctx.generate(sample)
        sample.loss_mask = [0] * len(sample.response_ids)  # every token is the environment's
        return sample
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "lockstep_test_failing_agents.py").write_text(textwrap.dedent(AGENTS))
    sys.path.insert(0, str(tmp_path))
    yield "lockstep_test_failing_agents"
    sys.path.remove(str(tmp_path))
    sys.modules.pop("lockstep_test_failing_agents", None)


def _manifest(tmp_path: Path, agent: str, steps: int) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["agent"]["agentFunction"] = agent
    doc["spec"]["algorithm"] |= {"batchSize": 1, "samplesPerPrompt": 2}
    doc["spec"]["rollout"]["sampling"]["maxNewTokens"] = 8
    doc["spec"]["schedule"]["steps"] = steps
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_run_whose_every_trajectory_fails_exits_6_naming_the_error(
    tmp_path: Path, cache: Path, agents: str, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = _manifest(tmp_path, f"{agents}:always_fails", steps=3)
    run_dir = tmp_path / "run"
    code = main(["run", str(manifest), "--run-dir", str(run_dir), "--cache-dir", str(cache)])
    err = capsys.readouterr().err
    assert code == 6, err[-2000:]
    assert "rollout failed: step 1: all 2 trajectories failed" in err
    assert "RuntimeError: the sandbox refused to start: no shell in the image" in err
    assert read_jsonl(run_dir / "metrics.jsonl", "train") == []  # nothing was trained


def test_steps_without_a_trained_token_report_degraded(tmp_path: Path, cache: Path, agents: str) -> None:
    manifest = _manifest(tmp_path, f"{agents}:trains_nothing", steps=ZERO_TOKEN_STEPS)
    reporter = NullReporter()
    state = run(load_manifest(manifest), tmp_path / "run", RunOptions(cache_dir=cache), reporter=reporter)
    assert state.step == ZERO_TOKEN_STEPS
    last = reporter.last
    assert last is not None and last.degraded is not None, last
    assert f"{ZERO_TOKEN_STEPS} steps in a row trained no token" in last.degraded
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl", "train")
    assert [r["trained_tokens"] for r in rows] == [0.0] * ZERO_TOKEN_STEPS


def _group(
    index: int, *, status: SampleStatus = SampleStatus.COMPLETED, mask: int = 1, reward: float = 1.0
) -> Group:
    samples = [
        Sample(index, i, [1, 2], [3, 4], [mask, mask], [-0.1, -0.2], [0, 0], reward=reward, status=status)
        for i in range(2)
    ]
    return Group(index, samples)


def test_the_batch_watch_table() -> None:
    reporter = NullReporter()
    watch = BatchWatch(DriverProgress(reporter))
    failed = Group(
        0, [Sample(0, i, [1], status=SampleStatus.FAILED, metadata={"error": f"E{i}"}) for i in range(2)]
    )
    with pytest.raises(RolloutFailed, match=r"step 7: all 2 trajectories failed \(last error: E1\)"):
        watch.check(7, [failed])
    assert watch.check(1, [failed, _group(1)])["failed_frac"] == 0.5  # some failed: trains the rest
    boxes = {SANDBOX_KEY: {"aborted": "Claim", "error": "no sandbox could be claimed in 60 s"}}
    sandboxed = Group(
        3, [Sample(3, i, [1], status=SampleStatus.ABORTED, metadata=dict(boxes)) for i in range(2)]
    )
    with pytest.raises(RolloutFailed, match="last error: sandbox Claim: no sandbox could be claimed"):
        watch.check(8, [sandboxed])  # each sandbox failure aborts its sample; all of them fail the step
    with pytest.raises(NonFiniteLoss, match="reward 1e\\+300 would make a non-finite loss"):
        watch.check(2, [_group(1, reward=1e300)])
    for step in range(1, ZERO_TOKEN_STEPS + 1):
        assert watch.check(step, [_group(step, mask=0)])["trained_tokens"] == 0.0
        assert (watch.degraded is not None) is (step == ZERO_TOKEN_STEPS)
    assert reporter.last is not None and reporter.last.degraded == watch.degraded
    watch.check(9, [_group(9)])  # tokens again: recovered
    assert watch.degraded is None and reporter.last.degraded is None
