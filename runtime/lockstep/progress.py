"""The progress channel's writer: build the job's progress document and deliver it somewhere.

Why it exists: in a cluster the operator learns the job's step, weight version, reward, staleness and
queue size only from the ConfigMap `<job>-progress`, the one object the driver pod's ServiceAccount
may get/patch. `ProgressTracker` turns the loop's per-step metrics into a `ProgressReport` (pure, no
I/O); a `ProgressReporter` delivers it: `NullReporter` for a local `lockstep run`,
`ConfigMapReporter` in a pod (a JSON merge patch through the `kubernetes` client with the pod's
ServiceAccount token, re-read per request; lockstep.kube), which adds every engine's weight version by
address (`EngineVersionProbe` over the pool's headless Service) so the operator can gate engine
readiness. A failed report is logged and counted, never raised: a flaky API server must not stop
training. A driver or trainer rank that cannot start (START_FAILURES) reports `start_failure`
instead, so the job fails with the reason rather than the pod restarting in a loop.

Both processes write here (the driver its steps, a trainer rank its start failure), so it sits below
both: the trainer rank imports it without importing the driver (pyproject's import contracts).

Who calls it: lockstep.driver.components and lockstep.driver.loop (`DriverProgress`, which the sync,
fully-async and init steps call through Components.progress), lockstep.cli.driver and
lockstep.cli.trainer (`reporter_from_env`, `start_failure`), the e2e tests of the channel.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lockstep.api.auth import auth_headers
from lockstep.api.progress import PROGRESS_KEY, ProgressReport, progress_config_map_name, progress_patch
from lockstep.kube import SERVICE_ACCOUNT_DIR, RetryPolicy, use_token_file
from lockstep.serving.lora import parse_served_name
from lockstep.serving.membership import ENGINE_PORT, ENGINES_SERVICE_ENV, engine_url, resolve_addresses
from lockstep.weights.fallback import FALLBACK_METRIC
from lockstep.weights.phases import phases_of
from lockstep.weights.preflight import PREFLIGHT_FILE, PreflightResult

log = logging.getLogger(__name__)

CONFIGMAP_ENV = "LOCKSTEP_PROGRESS_CONFIGMAP"
"""Env var the operator sets on the driver pod: the progress ConfigMap's name (resources/pods.py)."""
JOB_ENV = "LOCKSTEP_JOB"
"""Env var naming the RLJob (fallback for the ConfigMap name `<job>-progress`)."""
NAMESPACE_ENV = "LOCKSTEP_NAMESPACE"
"""Optional env var overriding the namespace file of the ServiceAccount."""
REWARD_EMA = 0.9
"""Weight of the previous reward average in the moving average (0.9: about the last 10 steps)."""
START_FAILURES: tuple[type[BaseException], ...] = (
    ValueError,  # a bad manifest or setting, a checkpoint that is not one (the message names the field)
    LookupError,  # an unregistered family or task
    FileNotFoundError,  # a missing checkpoint, tokenizer or prompt file
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    NotImplementedError,  # a model this runtime does not build
    ImportError,  # a user function or an optional backend that is not installed
)
"""Errors a process cannot recover from by restarting: reported as the job's error when they stop a
driver or a trainer rank at start. An unreachable engine or trainer group is not among them (the pod
restarts and tries again)."""


class ProgressReporter(Protocol):
    """Delivers progress documents; never raises on a delivery failure."""

    failures: int
    """Reports that could not be delivered (after retries)."""

    def report(self, report: ProgressReport) -> bool:
        """Deliver `report`; True when it arrived, False (logged, counted) when it did not."""
        ...


@dataclass(slots=True)
class NullReporter:
    """Reports nowhere: the local `lockstep run` has no operator; the last document is kept for tests."""

    failures: int = 0
    """Always 0."""
    last: ProgressReport | None = None
    """The most recent document given to report()."""

    def report(self, report: ProgressReport) -> bool:
        self.last = report
        return True


@dataclass(slots=True)
class ProgressTracker:
    """Builds the progress document from the loop's metrics; keeps what later documents repeat.

    Pure: no clock, no I/O. The document is cumulative (each one carries the pre-flight result and the
    last weight update), because the operator only ever reads the latest.
    """

    reward_ema: float = REWARD_EMA
    """Weight of the previous average in the reward moving average."""
    current: ProgressReport = field(default_factory=ProgressReport)
    """The latest document built."""

    def after_init(
        self, metrics: Mapping[str, float], preflight: PreflightResult | None = None, step: int = 0
    ) -> ProgressReport:
        """The document after the init step (the first update, through the pre-flight when it ran);
        `step` is the resumed step (0 on a fresh start)."""
        update = _update_fields(metrics)
        update["step"] = step
        if preflight is not None:
            update |= _preflight_fields(preflight)
        return self._set(update)

    def preflight_failed(self, preflight: PreflightResult) -> ProgressReport:
        """The document after a failed pre-flight (the driver stops with an error afterwards)."""
        return self._set(_preflight_fields(preflight))

    def after_step(
        self, step: int, metrics: Mapping[str, float], engine_versions: Mapping[str, int] | None = None
    ) -> ProgressReport:
        """The document after optimizer step `step` with that step's metrics."""
        update = _update_fields(metrics)
        update["step"] = step
        # With OPD's taskReward zero the trained reward is 0: the column shows the task reward.
        reward = metrics.get("task_reward_mean", metrics.get("reward_mean"))
        if reward is not None:
            r = float(reward)
            prev = self.current.reward
            update["reward"] = r if prev is None else self.reward_ema * prev + (1 - self.reward_ema) * r
        if "staleness_s_old_max" in metrics:
            update["staleness"] = int(metrics["staleness_s_old_max"])
        if "staleness_token_weighted_mean" in metrics:
            update["avg_staleness"] = float(metrics["staleness_token_weighted_mean"])
        if "queue_size" in metrics:
            update["queue_size"] = int(metrics["queue_size"])
        if metrics.get("queue_capacity", 0) >= 1:
            update["queue_capacity"] = int(metrics["queue_capacity"])
        if engine_versions is not None:
            update["engine_versions"] = dict(engine_versions)
        if "sandbox_aborted_samples" in metrics:  # a count per step: the report keeps the sum
            update["sandbox_aborts"] = (self.current.sandbox_aborts or 0) + int(
                metrics["sandbox_aborted_samples"]
            )
        return self._set(update)

    def finished(self) -> ProgressReport:
        """The last document of a run that did all its steps."""
        return self._set({"done": True})

    def degraded(self, reason: str | None) -> ProgressReport:
        """The document saying why the run trains nothing (None: it trains again)."""
        return self._set({"degraded": reason[:4096] if reason else None})

    def failed(self, error: str, reason: str | None = None) -> ProgressReport:
        """The last document of a run that stopped on a fatal error (truncated to the field's limit);
        `reason` is the CamelCase reason the job fails with (None: the operator's DriverError)."""
        return self._set({"error": error[:4096] or "driver failed", "reason": reason})

    def _set(self, update: Mapping[str, object]) -> ProgressReport:
        if update.get("last_update_fallback"):
            update = {**update, "update_fallbacks": (self.current.update_fallbacks or 0) + 1}
        self.current = self.current.model_copy(update=dict(update))
        # model_copy skips validation: validate once so a bad value fails here, not in the operator.
        self.current = ProgressReport.model_validate(self.current.model_dump())
        return self.current


@dataclass(slots=True)
class DriverProgress:
    """What the loops call: the tracker building documents plus the reporter delivering them."""

    reporter: ProgressReporter = field(default_factory=NullReporter)
    """Where documents go (NullReporter locally, ConfigMapReporter in a driver pod)."""
    tracker: ProgressTracker = field(default_factory=ProgressTracker)
    """Builds the cumulative document."""

    def init(self, metrics: Mapping[str, float], run_dir: Path, step: int = 0) -> None:
        """After the first update; reads the pre-flight result the update wrote into `run_dir`, if any."""
        self.reporter.report(self.tracker.after_init(metrics, _read_preflight(run_dir), step))

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        """After optimizer step `step` with its metrics."""
        self.reporter.report(self.tracker.after_step(step, metrics))

    def finished(self) -> None:
        """All steps done: the job succeeds."""
        self.reporter.report(self.tracker.finished())

    def degraded(self, reason: str | None) -> None:
        """The run trains nothing (`reason`), or trains again (None): the job's Degraded condition."""
        self.reporter.report(self.tracker.degraded(reason))

    def failed(self, error: BaseException, run_dir: Path) -> None:
        """A fatal error stops the driver: report it (and a failed pre-flight's tensor names); the
        exception's `reason` class attribute, when it has one, is the reason the job fails with."""
        preflight = _read_preflight(run_dir)
        if preflight is not None and not preflight.passed:
            self.tracker.preflight_failed(preflight)
        reason = getattr(error, "reason", None)
        text = f"{type(error).__name__}: {error}"
        self.reporter.report(self.tracker.failed(text, reason if isinstance(reason, str) else None))

    def start_failed(self, error: BaseException) -> None:
        """The driver cannot start (START_FAILURES): the job fails with DriverStartFailed."""
        self.reporter.report(start_failure(error, "driver"))


def start_failure(error: BaseException, who: str) -> ProgressReport:
    """The document of a process (`who`: driver, trainer rank 3) that could not start (pure)."""
    reason = "DriverStartFailed" if who == "driver" else "TrainerStartFailed"
    text = f"{who} could not start: {type(error).__name__}: {error}"
    return ProgressReport(error=text[:4096], reason=reason)


def _read_preflight(run_dir: Path) -> PreflightResult | None:
    """The PreflightResult first_update wrote into the run dir, or None when the check did not run."""
    path = run_dir / PREFLIGHT_FILE
    if not path.exists():
        return None
    return PreflightResult.model_validate_json(path.read_text())


def _update_fields(metrics: Mapping[str, float]) -> dict[str, object]:
    """Weight-update fields present in a step's metrics (update_weights / first_update)."""
    out: dict[str, object] = {}
    if "weight_version" in metrics:
        out["weight_version"] = int(metrics["weight_version"])
    if "update_weights_s" in metrics:
        out["last_update_seconds"] = max(float(metrics["update_weights_s"]), 0.0)
    if "update_weights_wire_bytes" in metrics:
        out["wire_bytes"] = int(metrics["update_weights_wire_bytes"])
    found = phases_of(dict(metrics))
    if found:
        out["last_update_phases"] = {p: round(max(s, 0.0), 6) for p, s in found.items()}
    if (
        "update_weights_s" in metrics
    ):  # an update happened: which transport delivered it when not the channel's
        via = [
            k[len(FALLBACK_METRIC) + 1 :]
            for k, v in metrics.items()
            if k.startswith(f"{FALLBACK_METRIC}_") and v
        ]
        out["last_update_fallback"] = via[0].replace("_", "-") if via else None
    return out


def _preflight_fields(result: PreflightResult) -> dict[str, object]:
    names = sorted({m.name for m in result.mismatches})
    return {"preflight": "passed" if result.passed else "failed", "preflight_mismatched": names}


@dataclass(slots=True)
class EngineVersionProbe:
    """Asks every engine behind a headless Service which weight version it holds.

    The driver reaches the pool through its router and knows no pod names; the operator needs each
    engine's version to gate its readiness. So each report resolves the headless Service `host` (every
    engine pod's IP, ready or not) and asks each address the SGLang contract's question (GET
    /model_info; `weight_version`, as
    lockstep.serving.client.EngineClient.get_weight_version reads it). An engine that does not answer
    or reports no integer version is left out: the operator counts it as not holding the current one.

    With `adapter` (a LoRA job) the version is the job's adapter version instead, since an engine's
    weight_version is its base's, which adapters never move: the newest `<adapter>-v<N>` the engine
    lists at GET /v1/models (SGLang's model cards of the loaded adapters, asked with the engines' key).
    An engine holding none of the job's versions (one that joined since the last update) is left
    out, so the operator keeps it out of the router until the trainer has loaded the job's next
    version there (lockstep.weights.adapter loads every version on every engine it reaches).
    """

    host: str
    """DNS name of the pool's headless engines Service (LOCKSTEP_ENGINES_SERVICE)."""
    port: int = ENGINE_PORT
    """The engines' HTTP port."""
    timeout_s: float = 2.0
    """HTTP timeout per engine."""
    resolve: Callable[[str, int], list[str]] = resolve_addresses
    """host, port -> IP addresses (DNS by default)."""
    adapter: str | None = None
    """A LoRA job's adapter name: report the adapter version each engine holds (see the class doc)."""

    def versions(self) -> dict[str, int] | None:
        """`<IP>:<port>` -> weight version of each engine that answered; None when the name does not
        resolve (unknown, not "no engine holds it": the operator then keeps the pods' readiness)."""
        import httpx

        try:
            addresses = self.resolve(self.host, self.port)
        except OSError as e:
            log.warning("engine versions not reported: %s does not resolve: %s", self.host, e)
            return None
        out: dict[str, int] = {}
        with httpx.Client(timeout=self.timeout_s) as http:
            for ip in addresses:
                base = engine_url(ip, self.port)
                try:
                    version = (
                        self._adapter_version(http, base) if self.adapter else self._base_version(http, base)
                    )
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                    log.info("engine %s:%d: no weight version (%s)", ip, self.port, type(e).__name__)
                    continue
                if version is not None:
                    out[f"{ip}:{self.port}"] = version
        return out

    @staticmethod
    def _base_version(http: Any, base: str) -> int:
        r = http.get(f"{base}/model_info")
        r.raise_for_status()
        return int(r.json()["weight_version"])

    def _adapter_version(self, http: Any, base: str) -> int | None:
        """The newest version of this job's adapter loaded on the engine; None: none is."""
        r = http.get(f"{base}/v1/models", headers=auth_headers())
        r.raise_for_status()
        cards = r.json()["data"]
        held = [parse_served_name(str(c["id"])) for c in cards if c.get("parent") is not None]
        return max((v for a, v in filter(None, held) if a == self.adapter), default=None)


@dataclass(slots=True)
class ConfigMapReporter:
    """Patches the progress document into ConfigMap `name` in `namespace` on the API server.

    The token is read from `token_path` on every report (kubelet rotates projected tokens) and is never
    logged. Each report is tried `attempts` times, `backoff_s` apart, then dropped with a warning.
    """

    api_url: str
    """API server base URL, e.g. https://10.96.0.1:443."""
    namespace: str
    """Namespace of the ConfigMap (the driver pod's own)."""
    name: str
    """ConfigMap name, `<job>-progress`."""
    token_path: Path = SERVICE_ACCOUNT_DIR / "token"
    """File holding the ServiceAccount bearer token."""
    ca_path: Path | None = SERVICE_ACCOUNT_DIR / "ca.crt"
    """CA bundle verifying the API server; None uses the system trust store."""
    attempts: int = 3
    """Tries per report before it is dropped."""
    backoff_s: float = 0.5
    """Pause between tries (doubling)."""
    timeout_s: float = 5.0
    """HTTP timeout of one try."""
    sleep: Callable[[float], None] = time.sleep
    """Injected sleep (tests pass a no-op)."""
    failures: int = 0
    """Reports dropped after all tries."""
    last_error: str = ""
    """Why the last failed report failed (status code and API server message; no token)."""
    probe: EngineVersionProbe | None = None
    """Asks every engine for its version; each report with a weight version then carries
    engineAddressVersions (in a driver pod: the pool's headless Service, LOCKSTEP_ENGINES_SERVICE)."""
    key: str = PROGRESS_KEY
    """The data key written: the driver's `progress.json`, a trainer rank's `rank-<r>.json`."""

    @property
    def path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/configmaps/{self.name}"

    def report(self, report: ProgressReport) -> bool:
        if self.probe is not None and report.weight_version is not None:
            fields = {**report.model_dump(), "engine_address_versions": self.probe.versions()}
            report = ProgressReport.model_validate(fields)
        body = progress_patch(report, self.key)
        policy = RetryPolicy(attempts=self.attempts, initial_s=self.backoff_s, max_s=30.0)
        attempt = 1
        while True:
            status, retry_after = self._patch(body)
            if status is not None and status < 300:
                return True
            delay = policy.delay(attempt, status, retry_after)
            if delay is None:  # a refused or malformed patch (4xx) or the tries are used up
                break
            self.sleep(delay)
            attempt += 1
        self.failures += 1
        log.warning(
            "progress report to ConfigMap %s/%s failed (%d so far): %s",
            self.namespace,
            self.name,
            self.failures,
            self.last_error,
        )
        return False

    def _patch(self, body: dict[str, Any]) -> tuple[int | None, str | None]:
        """One merge patch; (HTTP status or None without an answer, Retry-After); records last_error."""
        from kubernetes.client import ApiClient, Configuration, CoreV1Api
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        conf = Configuration(host=self.api_url)
        conf.ssl_ca_cert = str(self.ca_path) if self.ca_path is not None else None
        conf.retries = False  # our policy retries (the library's would retry connects silently)
        try:
            use_token_file(conf, self.token_path)
            with ApiClient(conf) as api:
                CoreV1Api(api).patch_namespaced_config_map(
                    self.name,
                    self.namespace,
                    body,
                    _content_type="application/merge-patch+json",
                    _request_timeout=self.timeout_s,
                )
            return 200, None
        except ApiException as e:
            self.last_error = f"HTTP {e.status}: {_message(e.body)}"
            return int(e.status or 0), (e.headers or {}).get("Retry-After")
        except (OSError, ValueError, HTTPError) as e:
            self.last_error = f"{type(e).__name__}: {e}"
            return None, None


def _message(body: object) -> str:
    """The API server's Status message of a failed response (bounded; no request headers)."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else str(body or "")
    try:
        msg = json.loads(text).get("message", "")
    except (ValueError, AttributeError):
        msg = text
    return str(msg)[:300]


def reporter_from_env(
    env: Mapping[str, str] | None = None, sa_dir: Path = SERVICE_ACCOUNT_DIR, key: str = PROGRESS_KEY
) -> ProgressReporter:
    """ConfigMapReporter inside a driver or trainer rank pod, else NullReporter.

    In a pod: the operator sets LOCKSTEP_PROGRESS_CONFIGMAP (else LOCKSTEP_JOB gives `<job>-progress`)
    and LOCKSTEP_ENGINES_SERVICE (the driver's reports then carry every engine's version), Kubernetes
    sets KUBERNETES_SERVICE_HOST/PORT and mounts the ServiceAccount files in `sa_dir`. `key` is the
    data key written (a trainer rank's is `rank_key(rank)`; it probes no engine).
    """
    env = os.environ if env is None else env
    name = env.get(CONFIGMAP_ENV) or (progress_config_map_name(env[JOB_ENV]) if env.get(JOB_ENV) else "")
    host = env.get("KUBERNETES_SERVICE_HOST", "")
    token = sa_dir / "token"
    if not name or not host or not token.exists():
        if name:
            log.warning(
                "%s=%s is set but KUBERNETES_SERVICE_HOST or %s is missing: progress is not reported",
                CONFIGMAP_ENV,
                name,
                token,
            )
        return NullReporter()
    ns_file = sa_dir / "namespace"
    namespace = env.get(NAMESPACE_ENV) or (ns_file.read_text().strip() if ns_file.exists() else "default")
    port = env.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host  # an IPv6 service address
    ca = sa_dir / "ca.crt"
    engines = env.get(ENGINES_SERVICE_ENV)
    return ConfigMapReporter(
        api_url=f"https://{host}:{port}",
        namespace=namespace,
        name=name,
        token_path=token,
        ca_path=ca if ca.exists() else None,
        probe=EngineVersionProbe(engines) if engines and key == PROGRESS_KEY else None,
        key=key,
    )
