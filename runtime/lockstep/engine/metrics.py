"""The reference engine's Prometheus series, read from the engine at scrape time.

Why it exists: the dashboard and the "engine not ready" alert (manifests/monitoring) need every engine
pod to say whether it serves, which weight version it holds and how many tokens it produced. A
collector reads the live state when scraped (nothing to update on the hot path). Names follow the
rest of Lockstep (`lockstep_engine_*`) on the pod's `metrics` port.

SGLang (`--enable-metrics`) serves its own `sglang:*` series at GET /metrics of its HTTP port; the
reference engine serves the subset it measures the same way (SGLangCollector: same names and types as
sglang/srt/observability/metrics_collector.py, without SGLang's labels), so the dashboard panels and
rules read either engine. Both reach Prometheus on the pod's `metrics` port (the one port every job
NetworkPolicy admits from anywhere): the reference engine serves them there next to `lockstep_engine_*`
(engine_registry), an SGLang pod relays its HTTP port's /metrics there (lockstep.cli.metrics_relay).
Not served (the reference engine has no paged KV pool and times no first token): token_usage,
time_to_first_token_seconds and the other latency histograms.

Who calls it: lockstep.cli.engine (served on $LOCKSTEP_METRICS_PORT in a pod), engine.server
(GET /metrics), tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lockstep.engine.core import ReferenceEngine


class EngineCollector:
    """Series of one engine; `ready()` is what GET /health would answer (True: 200)."""

    def __init__(self, engine: ReferenceEngine, ready: Callable[[], bool]) -> None:
        self.engine = engine
        self.ready = ready

    def collect(self) -> Iterator[Any]:
        stats = self.engine.stats
        yield GaugeMetricFamily(
            "lockstep_engine_ready", "1 while /health answers 200 (serving, not joining or draining)",
            value=1.0 if self.ready() else 0.0,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "lockstep_engine_weight_version",
            "Weight version the engine serves",
            value=float(self.engine.weight_version),
        )
        yield GaugeMetricFamily(
            "lockstep_engine_paused",
            "1 while generation is paused (a weight update)",
            value=float(self.engine.is_paused),
        )
        for name, help_text, value in (
            ("lockstep_engine_prompt_tokens", "Prompt tokens of admitted requests", stats.prompt_tokens),
            (
                "lockstep_engine_cached_tokens",
                "Prompt tokens reused from the prefix cache",
                stats.cached_tokens,
            ),
            ("lockstep_engine_generated_tokens", "Tokens sampled", stats.generated_tokens),
            ("lockstep_engine_requests", "Requests finished (any reason)", stats.requests),
            ("lockstep_engine_failed_steps", "Scheduler steps that raised", stats.failed_steps),
        ):
            yield CounterMetricFamily(name, help_text, value=float(value))

    def describe(self) -> list[Any]:
        return []


class SGLangCollector:
    """The `sglang:*` series the reference engine measures honestly (names and types as SGLang's)."""

    def __init__(self, engine: ReferenceEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        scheduler = self.engine.scheduler
        stats = self.engine.stats
        yield GaugeMetricFamily(
            "sglang:num_running_reqs",
            "The number of running requests.",
            value=float(len(scheduler.slots.running)),
        )
        yield GaugeMetricFamily(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            value=float(len(scheduler.waiting)),
        )
        for name, help_text, value in (
            ("sglang:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            ("sglang:generation_tokens", "Number of generation tokens processed.", stats.generated_tokens),
            ("sglang:num_requests", "Number of requests processed.", stats.requests),
        ):
            yield CounterMetricFamily(name, help_text, value=float(value))

    def describe(self) -> list[Any]:
        return []


def sglang_registry(engine: ReferenceEngine) -> CollectorRegistry:
    """A registry holding only `engine`'s `sglang:*` series (GET /metrics of the engine's HTTP port)."""
    registry = CollectorRegistry()
    registry.register(SGLangCollector(engine))
    return registry


def engine_registry(engine: ReferenceEngine, ready: Callable[[], bool]) -> CollectorRegistry:
    """A registry holding `engine`'s series, `lockstep_engine_*` and `sglang:*` (the `metrics` port)."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, ready))
    registry.register(SGLangCollector(engine))
    return registry
