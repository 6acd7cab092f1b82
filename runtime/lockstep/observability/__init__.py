"""Observability: per-step metrics to JSON lines and Prometheus, and an end-of-run plot.

Why it exists: the mismatch metrics are the reason Lockstep exists; they must be visible while a run
goes (Prometheus gauges, a progress bar) and after it (metrics.jsonl, metrics.png).

Who calls it: lockstep.driver (sync loop) and lockstep.driver.fully_async.
"""

from lockstep.observability.metrics import MetricsSink, read_jsonl

__all__ = ["MetricsSink", "read_jsonl"]
