"""The driver's progress document (pure) and its delivery by ConfigMapReporter to a real loopback server.

The document is what the operator folds into RLJob status; these tests pin the mapping from the
loop's metric names to the document's fields, and that a failed delivery is counted, never raised.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from lockstep.api.progress import PROGRESS_KEY, ProgressReport
from lockstep.progress import ConfigMapReporter, NullReporter, ProgressTracker, reporter_from_env
from lockstep.weights.preflight import PreflightResult, TensorMismatch

STEP_METRICS = {
    "reward_mean": 0.5,
    "weight_version": 3.0,
    "update_weights_s": 0.25,
    "update_weights_wire_bytes": 1234.0,
    "staleness_s_old_max": 2.0,
    "staleness_token_weighted_mean": 0.75,
    "queue_size": 5.0,
    "queue_capacity": 8.0,
}


def test_document_of_init_and_steps_golden() -> None:
    t = ProgressTracker(reward_ema=0.5)
    ok = PreflightResult(passed=True, engines=2, checked_tensors=10)
    first = t.after_init({"weight_version": 0.0, "update_weights_s": 0.1}, ok)
    assert first.model_dump(by_alias=True, exclude_none=True) == {
        "step": 0,
        "weightVersion": 0,
        "lastUpdateSeconds": 0.1,
        "preflight": "passed",
        "preflightMismatched": [],
        "engineVersions": {},
        "done": False,
    }
    t.after_step(1, {**STEP_METRICS, "reward_mean": 1.0}, {"pool-0": 3})
    doc = t.after_step(2, STEP_METRICS)
    assert doc.model_dump(by_alias=True, exclude_none=True) == {
        "step": 2,
        "weightVersion": 3,
        "reward": 0.75,  # 0.5 * 1.0 + 0.5 * 0.5
        "staleness": 2,
        "avgStaleness": 0.75,
        "queueSize": 5,
        "queueCapacity": 8,
        "engineVersions": {"pool-0": 3},
        "preflight": "passed",
        "preflightMismatched": [],
        "lastUpdateSeconds": 0.25,
        "wireBytes": 1234,
        "done": False,
    }
    assert t.finished().done is True
    assert t.failed("x" * 5000).error == "x" * 4096


def test_update_phases_reach_the_document() -> None:
    t = ProgressTracker()
    metrics = {**STEP_METRICS, "update_weights_transfer_s": 0.2, "update_weights_pause_s": 0.05}
    doc = t.after_step(1, metrics)
    wire = doc.model_dump(by_alias=True, exclude_none=True)
    assert wire["lastUpdatePhases"] == {"transfer": 0.2, "pause": 0.05}
    assert t.after_step(2, {"reward_mean": 0.1}).last_update_phases == {"transfer": 0.2, "pause": 0.05}


def test_a_fallback_is_named_until_the_chosen_transport_delivers_again() -> None:
    t = ProgressTracker()
    fell = {**STEP_METRICS, "update_weights_fallback": 1.0, "update_weights_fallback_broadcast": 1.0}
    doc = t.after_step(1, fell)
    assert doc.last_update_fallback == "broadcast" and doc.update_fallbacks == 1
    wire = doc.model_dump(by_alias=True, exclude_none=True)
    assert wire["lastUpdateFallback"] == "broadcast" and wire["updateFallbacks"] == 1
    assert t.after_step(2, fell).update_fallbacks == 2
    back = t.after_step(3, {**STEP_METRICS, "update_weights_fallback": 0.0})
    assert back.last_update_fallback is None and back.update_fallbacks == 2  # the count stays
    assert t.after_step(4, {"reward_mean": 0.1}).last_update_fallback is None  # no update: unchanged


def test_sync_step_without_queue_leaves_queue_fields_unset() -> None:
    doc = ProgressTracker().after_step(1, {"reward_mean": 0.2, "weight_version": 1.0})
    assert doc.queue_size is None and doc.queue_capacity is None and doc.staleness is None
    assert doc.reward == 0.2


def test_failed_preflight_names_the_differing_tensors() -> None:
    bad = PreflightResult(
        passed=False,
        engines=1,
        checked_tensors=3,
        mismatches=[
            TensorMismatch(engine="e0", name="lm_head.weight", reason="checksum"),
            TensorMismatch(engine="e1", name="lm_head.weight", reason="checksum"),
            TensorMismatch(engine="e0", name="embed.weight", reason="missing"),
        ],
    )
    doc = ProgressTracker().preflight_failed(bad)
    assert doc.preflight == "failed"
    assert doc.preflight_mismatched == ["embed.weight", "lm_head.weight"]


class _Recorder(BaseHTTPRequestHandler):
    status: ClassVar[int] = 200
    seen: ClassVar[list[tuple[str, str, dict[str, str], Any]]] = []
    first: ClassVar[list[tuple[int, dict[str, str]]]] = []
    """(status, headers) answered before `status` (a scripted 429 or 503 first)."""

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        headers = {k.lower(): v for k, v in self.headers.items()}  # header names are case-insensitive
        type(self).seen.append((self.path, self.headers["Content-Type"], headers, body))
        status, extra = type(self).first.pop(0) if type(self).first else (type(self).status, {})
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for key, value in extra.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(json.dumps({"kind": "Status", "message": "nope"}).encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api() -> Iterator[tuple[str, type[_Recorder]]]:
    handler = type("Handler", (_Recorder,), {"seen": [], "status": 200, "first": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_configmap_reporter_sends_a_merge_patch_with_the_token(
    api: tuple[str, type[_Recorder]], tmp_path: Path
) -> None:
    url, handler = api
    (tmp_path / "token").write_text("secret-token\n")
    rep = ConfigMapReporter(url, "ns1", "job-progress", token_path=tmp_path / "token", ca_path=None)
    assert rep.report(ProgressReport(step=4, weight_version=4))
    (path, ctype, headers, body) = handler.seen[0]
    assert path == "/api/v1/namespaces/ns1/configmaps/job-progress"
    assert ctype == "application/merge-patch+json"
    assert headers["authorization"] == "Bearer secret-token"  # header names are case-insensitive
    assert json.loads(body["data"][PROGRESS_KEY])["weightVersion"] == 4
    assert rep.failures == 0


def test_failed_report_is_counted_not_raised_and_never_logs_the_token(
    api: tuple[str, type[_Recorder]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, handler = api
    handler.status = 500
    (tmp_path / "token").write_text("secret-token")
    rep = ConfigMapReporter(
        url, "ns1", "job-progress", token_path=tmp_path / "token", ca_path=None, sleep=lambda s: None
    )
    assert rep.report(ProgressReport(step=1)) is False
    assert len(handler.seen) == 3  # retried: a 500 may pass
    handler.status = 403
    assert rep.report(ProgressReport(step=2)) is False
    assert len(handler.seen) == 4  # not retried: Forbidden stays Forbidden
    assert rep.failures == 2 and "403" in rep.last_error
    assert "secret-token" not in caplog.text and "nope" in caplog.text
    unreachable = ConfigMapReporter(
        "http://127.0.0.1:9", "ns", "x", token_path=tmp_path / "token", ca_path=None, sleep=lambda s: None
    )
    assert unreachable.report(ProgressReport()) is False and unreachable.failures == 1


def test_throttled_report_is_retried_after_the_servers_retry_after(
    api: tuple[str, type[_Recorder]], tmp_path: Path
) -> None:
    """429 then 200 (the real API server cannot be made to throttle on demand: a loopback server
    answers the scripted statuses); the pause is the server's Retry-After, not the backoff."""
    url, handler = api
    handler.first.extend([(429, {"Retry-After": "2"}), (503, {})])
    (tmp_path / "token").write_text("t")
    slept: list[float] = []
    rep = ConfigMapReporter(
        url, "ns1", "j-progress", token_path=tmp_path / "token", ca_path=None, sleep=slept.append
    )
    assert rep.report(ProgressReport(step=1))
    assert slept == [2.0, 1.0] and len(handler.seen) == 3 and rep.failures == 0


def test_reporter_from_env(tmp_path: Path) -> None:
    assert isinstance(reporter_from_env({}, tmp_path), NullReporter)
    env = {"LOCKSTEP_PROGRESS_CONFIGMAP": "j-progress", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert isinstance(reporter_from_env(env, tmp_path), NullReporter)  # no token file: not in a pod
    (tmp_path / "token").write_text("t")
    (tmp_path / "namespace").write_text("team-a\n")
    rep = reporter_from_env({**env, "KUBERNETES_SERVICE_PORT": "6443"}, tmp_path)
    assert isinstance(rep, ConfigMapReporter)
    assert (rep.api_url, rep.namespace, rep.name, rep.ca_path) == (
        "https://10.0.0.1:6443",
        "team-a",
        "j-progress",
        None,
    )
    by_job = reporter_from_env({"LOCKSTEP_JOB": "j2", "KUBERNETES_SERVICE_HOST": "fd00::1"}, tmp_path)
    assert isinstance(by_job, ConfigMapReporter)
    assert (by_job.name, by_job.api_url) == ("j2-progress", "https://[fd00::1]:443")


class _ListReporter:
    """A ProgressReporter keeping every document (the loop's side of the channel, observed)."""

    def __init__(self) -> None:
        self.failures = 0
        self.docs: list[ProgressReport] = []

    def report(self, report: ProgressReport) -> bool:
        self.docs.append(report)
        return True


def _tiny_job(tmp_path: Path, **spec: dict[str, Any]) -> Path:
    """The tiny fast job with `spec.<key>` sections updated."""
    import yaml

    doc = yaml.safe_load((Path(__file__).parent / "fixtures" / "tiny-fast.yaml").read_text())
    for key, fields in spec.items():
        doc["spec"].setdefault(key, {}).update(fields)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    return tmp_path / "job.yaml"


def test_real_sync_loop_reports_init_each_step_and_done(tmp_path: Path) -> None:
    """The tiny job's real loop (engine on 127.0.0.1, FSDP2 trainer) with the pre-flight check on."""
    from lockstep.api import load_manifest
    from lockstep.driver import run
    from lockstep.driver.settings import RunOptions

    reporter = _ListReporter()
    state = run(
        load_manifest(_tiny_job(tmp_path, weightSync={"checkWeightUpdateEqual": True})),
        tmp_path / "run",
        RunOptions(steps=2, cache_dir=tmp_path / "cache"),
        reporter=reporter,
    )
    assert state.step == 2
    assert [d.step for d in reporter.docs] == [0, 1, 2, 2]
    init, first, second, last = reporter.docs
    assert init.preflight == "passed" and init.weight_version == 0 and init.reward is None
    assert (first.weight_version, second.weight_version) == (1, 2)
    assert first.reward is not None and second.preflight == "passed"
    assert second.last_update_seconds is not None and not second.done
    assert last.done and last.error is None


def test_real_fully_async_loop_reports_queue_staleness_and_wire_bytes(tmp_path: Path) -> None:
    """The fully-async loop over disk-delta: queue and staleness from the buffer, bytes from the push."""
    from lockstep.api import load_manifest
    from lockstep.driver import run
    from lockstep.driver.settings import RunOptions

    fixture = Path(__file__).parents[1] / "rollout" / "fixtures" / "tiny-async.yaml"
    text = fixture.read_text().replace("    evalInterval: 2\n", "")
    text = text.replace("transport: auto", "transport: disk-delta\n    checkWeightUpdateEqual: true")
    reporter = _ListReporter()
    run(
        load_manifest(text),
        tmp_path / "run",
        RunOptions(steps=2, cache_dir=tmp_path / "cache"),
        reporter=reporter,
    )
    assert [d.step for d in reporter.docs] == [0, 1, 2, 2]
    init, _, second, last = reporter.docs
    assert init.preflight == "passed" and init.queue_size is None
    assert second.queue_capacity is not None and second.queue_size is not None
    assert second.staleness is not None and second.avg_staleness is not None
    assert second.wire_bytes is not None and second.wire_bytes > 0
    assert second.weight_version == 2 and last.done


def test_fatal_error_is_reported_as_the_jobs_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN loss (a restart cannot fix it) ends the channel with `error`, not `done`."""
    from lockstep.api import load_manifest
    from lockstep.driver import run
    from lockstep.driver.settings import RunOptions
    from lockstep.trainer.protocol import NonFiniteLoss

    (tmp_path / "progress_nan_reward.py").write_text("def nan(sample, response):\n    return float('nan')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    job = load_manifest(_tiny_job(tmp_path, agent={"rewardFunction": "progress_nan_reward:nan"}))
    reporter = _ListReporter()
    with pytest.raises(NonFiniteLoss):
        run(job, tmp_path / "run", RunOptions(steps=2, cache_dir=tmp_path / "cache"), reporter=reporter)
    assert [d.step for d in reporter.docs] == [0, 0]
    assert reporter.docs[-1].error is not None and reporter.docs[-1].error.startswith("NonFiniteLoss: ")
    assert not reporter.docs[-1].done


@pytest.mark.parametrize(
    ("checkpoint", "error"),
    [("/nonexistent/qwen3", "CheckpointError"), ("builtin:no-such-model", None)],
    ids=["missing-directory", "unknown-builtin"],
)
def test_a_driver_that_cannot_start_reports_why_once(
    tmp_path: Path, checkpoint: str, error: str | None
) -> None:
    """A bad checkpoint stops the driver before any step: one document, error and DriverStartFailed."""
    from lockstep.api import load_manifest
    from lockstep.driver import run
    from lockstep.driver.settings import RunOptions
    from lockstep.progress import START_FAILURES

    job = load_manifest(_tiny_job(tmp_path, model={"checkpoint": checkpoint}))
    reporter = _ListReporter()
    with pytest.raises(START_FAILURES) as raised:
        run(job, tmp_path / "run", RunOptions(steps=1, cache_dir=tmp_path / "cache"), reporter=reporter)
    [doc] = reporter.docs
    assert doc.reason == "DriverStartFailed" and doc.step is None and not doc.done
    assert doc.error == f"driver could not start: {type(raised.value).__name__}: {raised.value}"
    assert checkpoint in doc.error
    if error is not None:
        assert type(raised.value).__name__ == error


def test_an_unreachable_engine_is_not_a_start_failure(tmp_path: Path) -> None:
    """The engine may come back: the pod restarts and tries again, the job does not fail."""
    from lockstep.api import load_manifest
    from lockstep.driver import run
    from lockstep.driver.settings import RunOptions
    from lockstep.serving.client import EngineUnreachable

    job = load_manifest(_tiny_job(tmp_path))
    reporter = _ListReporter()
    with pytest.raises(EngineUnreachable):
        run(
            job,
            tmp_path / "run",
            RunOptions(
                steps=1,
                cache_dir=tmp_path / "cache",
                engine_urls=("http://127.0.0.1:9",),
                engine_timeout_s=0.5,
            ),
            reporter=reporter,
        )
    assert reporter.docs == []


def test_start_failure_document_and_rank_key(api: tuple[str, type[_Recorder]], tmp_path: Path) -> None:
    from lockstep.api.progress import rank_key
    from lockstep.progress import start_failure

    doc = start_failure(FileNotFoundError("x" * 5000), "trainer rank 2")
    assert doc.reason == "TrainerStartFailed" and doc.error is not None and len(doc.error) == 4096
    assert doc.error.startswith("trainer rank 2 could not start: FileNotFoundError: xxx")
    assert start_failure(ValueError("bad"), "driver").reason == "DriverStartFailed"
    # a rank writes its own key: the driver's document is left alone
    url, handler = api
    (tmp_path / "token").write_text("t")
    rep = ConfigMapReporter(
        url, "ns", "j-progress", token_path=tmp_path / "token", ca_path=None, key=rank_key(2)
    )
    assert rep.report(doc)
    body = handler.seen[0][3]
    assert list(body["data"]) == ["rank-2.json"]
    assert ProgressReport.model_validate_json(body["data"]["rank-2.json"]) == doc


def test_a_rank_reporter_from_env_writes_its_key_and_probes_no_engine(tmp_path: Path) -> None:
    from lockstep.api.progress import rank_key

    (tmp_path / "token").write_text("t")
    env = {
        "LOCKSTEP_PROGRESS_CONFIGMAP": "j-progress",
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "LOCKSTEP_ENGINES_SERVICE": "j-rollout-engines",
    }
    driver = reporter_from_env(env, tmp_path)
    rank = reporter_from_env(env, tmp_path, key=rank_key(3))
    assert isinstance(driver, ConfigMapReporter) and isinstance(rank, ConfigMapReporter)
    assert (driver.key, driver.probe is not None) == (PROGRESS_KEY, True)
    assert (rank.key, rank.probe) == ("rank-3.json", None)


def test_a_trainer_rank_that_cannot_start_exits_2_naming_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Outside a pod there is no channel (NullReporter); e2e/test_operator_startup.py runs it in one."""
    from lockstep.cli import main

    job = _tiny_job(tmp_path, model={"checkpoint": "/nonexistent/ckpt"})
    argv = ["trainer", "--config", str(job), "--serve", "--out", str(tmp_path / "out")]
    assert main([*argv, "--engine-url", "http://127.0.0.1:9"]) == 2
    assert "/nonexistent/ckpt" in capsys.readouterr().err


def test_sandbox_aborts_add_up_across_steps() -> None:
    """Each step reports how many samples its sandboxes aborted; the document (and so the RLJob's
    status.sandboxAborts) carries the sum since the driver started."""
    t = ProgressTracker()
    assert t.after_step(1, {"reward_mean": 0.5}).sandbox_aborts is None  # a job without sandboxes
    assert t.after_step(2, {"reward_mean": 0.5, "sandbox_aborted_samples": 2.0}).sandbox_aborts == 2
    assert t.after_step(3, {"reward_mean": 0.5, "sandbox_aborted_samples": 0.0}).sandbox_aborts == 2
    doc = t.after_step(4, {"reward_mean": 0.5, "sandbox_aborted_samples": 1.0})
    assert json.loads(doc.model_dump_json(by_alias=True))["sandboxAborts"] == 3


def test_a_lora_jobs_loop_gives_the_reporter_it_was_handed_the_adapter_probe(tmp_path: Path) -> None:
    """In a driver pod the loop builds the ConfigMapReporter and hands it to the components: its
    engine probe must read the job's adapter versions (an engine's weight_version is its base's, 0,
    which gated every engine of a shared pool out of the router on the real node)."""
    from lockstep.api import load_manifest
    from lockstep.driver import run
    from lockstep.driver.settings import RunOptions
    from lockstep.progress import EngineVersionProbe

    class _Probed(_ListReporter):
        def __init__(self) -> None:
            super().__init__()
            self.probe = EngineVersionProbe("engines", resolve=lambda host, port: [])

    reporter = _Probed()
    job = _tiny_job(tmp_path, model={"lora": {"rank": 4, "alpha": 8}})
    state = run(
        load_manifest(job),
        tmp_path / "run",
        RunOptions(steps=1, cache_dir=tmp_path / "cache"),
        reporter=reporter,
    )
    assert state.step == 1
    assert reporter.probe.adapter == "tiny-fast"
