"""Writes manifests/monitoring/ from one source: scrape targets, rules and the dashboard's panels.

Why it exists: the same scrape targets, rules and queries ship in four shapes (PodMonitors for the
Prometheus Operator — the operator's own Service and ServiceMonitor are manifests/service.yaml and
manifests/optional/servicemonitor.yaml — a plain Prometheus scrape config, a plain rules file and
its PrometheusRule, a Grafana dashboard); written by hand they drift apart. They are data here and
files there; `--check` (run by operator/tests/test_monitoring.py) fails when a file differs from
what this script writes. docs/monitoring.md says what each series, rule and panel means.

Series (every job pod's `metrics` port, 9400; the operator's 9090):
- driver (job lockstep-driver): `lockstep_<step metric>` gauges of the last train step (lockstep_step,
  lockstep_reward_mean, lockstep_train_tokens, lockstep_update_weights_s, ...),
  lockstep_last_step_timestamp_seconds, fully-async: lockstep_staleness_* and lockstep_max_weight_staleness;
  agent jobs: the in-process session server's tito_* series;
- engines (lockstep-engine): the reference engine's lockstep_engine_*, and the engines' SGLang series on
  the same port (SGLang's own with --enable-metrics, relayed from its HTTP port by the pod's
  metrics-relay sidecar, or the reference engine's subset of the same names): sglang:num_running_reqs,
  sglang:num_queue_reqs, sglang:token_usage, sglang:generation_tokens_total,
  sglang:time_to_first_token_seconds, ...; trainer ranks (lockstep-trainer): lockstep_trainer_*;
- operator (job lockstep-operator here, its Service's name under the ServiceMonitor): lockstep_operator_*
  (the rules select them by name, not by job).
Every target carries namespace, pod, rljob, role (and pool for engines) from the pod's labels.

Run from the repository root:  .venv/bin/python manifests/monitoring/build.py [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
GROUP = "rl.lockstep.dev"
JOB_PORT = "metrics"
ROLES = ("driver", "engine", "trainer")
NO_STEP_MINUTES = 10
"""LockstepNoStep fires when a running job's driver reported no train step for this long."""
WEIGHT_SYNC_SLOW_S = 60
"""LockstepWeightSyncSlow fires when one weight sync takes longer than this (every step for 10 min)."""

BY_JOB = "namespace, rljob"

# ----------------------------------------------------------------------------------------- scraping


def _label(name: str) -> str:
    """A pod label as Prometheus' Kubernetes discovery names it."""
    return "__meta_kubernetes_pod_label_" + "".join(c if c.isalnum() else "_" for c in name)


TARGET_LABELS = {"rljob": f"{GROUP}/job", "role": f"{GROUP}/role", "pool": f"{GROUP}/pool"}
"""Target labels copied from the pod's labels (the same in the PodMonitors and the plain config)."""


def pod_monitor(role: str) -> dict[str, Any]:
    """The PodMonitor of one job role: every namespace, the pods of that role, port `metrics`."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": f"lockstep-{role}", "namespace": "lockstep-system",
                     "labels": {"app.kubernetes.io/part-of": "lockstep"}},
        "spec": {
            "namespaceSelector": {"any": True},
            "selector": {"matchLabels": {"app.kubernetes.io/managed-by": "lockstep-operator", f"{GROUP}/role": role}},
            "podMetricsEndpoints": [{
                "port": JOB_PORT,
                "interval": "15s",
                "relabelings": [
                    {"targetLabel": "job", "replacement": f"lockstep-{role}"},
                    *({"sourceLabels": [_label(pod_label)], "targetLabel": target}
                      for target, pod_label in TARGET_LABELS.items()),
                ],
            }],
        },
    }  # fmt: skip


def scrape_config() -> dict[str, Any]:
    """A plain Prometheus configuration equivalent to the PodMonitors and the ServiceMonitor
    (Kubernetes pod discovery; the `kubernetes_sd_configs` entries take api_server and credentials
    from the pod's service account when run in the cluster)."""
    jobs = []
    for role in ROLES:
        jobs.append({
            "job_name": f"lockstep-{role}",
            "scrape_interval": "15s",
            "kubernetes_sd_configs": [{"role": "pod"}],
            "relabel_configs": [
                {"source_labels": [_label("app.kubernetes.io/managed-by"), _label(f"{GROUP}/role")],
                 "regex": f"lockstep-operator;{role}", "action": "keep"},
                {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": JOB_PORT, "action": "keep"},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                *({"source_labels": [_label(pod_label)], "target_label": target}
                  for target, pod_label in TARGET_LABELS.items()),
            ],
        })  # fmt: skip
    jobs.append({
        "job_name": "lockstep-operator",
        "scrape_interval": "15s",
        "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": ["lockstep-system"]}}],
        "relabel_configs": [
            {"source_labels": [_label("app.kubernetes.io/name")], "regex": "lockstep-operator", "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "metrics", "action": "keep"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        ],
    })  # fmt: skip
    return {
        "global": {"evaluation_interval": "15s"},
        "rule_files": ["lockstep.rules.yaml"],
        "scrape_configs": jobs,
    }


# -------------------------------------------------------------------------------------------- rules


def _record(name: str, expr: str) -> dict[str, Any]:
    return {"record": name, "expr": expr}


def _alert(name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict[str, Any]:
    return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description}}  # fmt: skip


RECORDS = [
    _record("rljob:lockstep_steps_per_minute:deriv5m",
            f'60 * max by ({BY_JOB}) (deriv(lockstep_step{{job="lockstep-driver"}}[5m]))'),
    _record("rljob:lockstep_trained_tokens_per_second:deriv5m",
            f'max by ({BY_JOB}) (lockstep_train_tokens{{job="lockstep-driver"}})'
            f' * max by ({BY_JOB}) (deriv(lockstep_step{{job="lockstep-driver"}}[5m]))'),
    _record("rljob:lockstep_engine_generated_tokens:rate5m",
            f'sum by ({BY_JOB}) (rate(lockstep_engine_generated_tokens_total{{job="lockstep-engine"}}[5m]))'),
    _record("rljob:lockstep_engines_ready:sum",
            f'sum by ({BY_JOB}) (lockstep_engine_ready{{job="lockstep-engine"}})'),
    _record("rljob:lockstep_engines:count",
            f'count by ({BY_JOB}) (up{{job="lockstep-engine"}})'),
    _record("rljob:lockstep_trainer_command_seconds:p90_5m",
            f'histogram_quantile(0.9, sum by ({BY_JOB}, command, le) '
            f'(rate(lockstep_trainer_command_seconds_bucket{{job="lockstep-trainer"}}[5m])))'),
    _record("kind:lockstep_operator_reconciles:rate5m",
            'sum by (kind, result) (rate(lockstep_operator_reconciles_total[5m]))'),
]  # fmt: skip

ALERTS = [
    _alert("LockstepNoStep",
           f'time() - lockstep_last_step_timestamp_seconds{{job="lockstep-driver"}} > {NO_STEP_MINUTES * 60}',
           "1m", "critical", "RLJob {{ $labels.namespace }}/{{ $labels.rljob }}: no train step for "
           f"{NO_STEP_MINUTES} minutes",
           "The driver is up but its last train step ended {{ $value | humanizeDuration }} ago: look at "
           "`kubectl describe rljob` (Events), then the engines (rollouts stuck?) and the trainer ranks."),
    _alert("LockstepStalenessOverBound",
           f'max by ({BY_JOB}) (lockstep_staleness_s_old_max{{job="lockstep-driver"}})'
           f' > on ({BY_JOB}) max by ({BY_JOB}) (lockstep_max_weight_staleness{{job="lockstep-driver"}})',
           "5m", "warning", "RLJob {{ $labels.namespace }}/{{ $labels.rljob }}: consumed data older than "
           "schedule.maxWeightStaleness",
           "A fully-async step trained on groups {{ $value }} versions old, beyond the bound: the buffer's "
           "filter is not holding (docs/design.md §5)."),
    _alert("LockstepWeightSyncSlow",
           f'lockstep_update_weights_s{{job="lockstep-driver"}} > {WEIGHT_SYNC_SLOW_S}',
           "10m", "warning", "RLJob {{ $labels.namespace }}/{{ $labels.rljob }}: weight sync takes "
           "{{ $value | humanizeDuration }}",
           f"Every weight sync took more than {WEIGHT_SYNC_SLOW_S} s for 10 minutes: check the transport "
           "(status.transportReason) and the engines' network."),
    _alert("LockstepZeroTrainedTokens",
           'lockstep_train_tokens{job="lockstep-driver"} == 0',
           "10m", "critical", "RLJob {{ $labels.namespace }}/{{ $labels.rljob }}: steps train on no token",
           "The last steps' batches had no trainable token (every group filtered or failed): check "
           "lockstep_failed_samples and the reward."),
    _alert("LockstepEngineNotReady",
           'lockstep_engine_ready{job="lockstep-engine"} == 0 or up{job="lockstep-engine"} == 0',
           "5m", "warning", "Engine {{ $labels.namespace }}/{{ $labels.pod }} not ready for 5 minutes",
           "It answers /health with 503 (a weight-group join or a drain that does not end) or does not "
           "answer at all."),
    _alert("LockstepOperatorReconcileErrors",
           'sum by (kind) (rate(lockstep_operator_reconciles_total{result="error"}[5m])) > 0',
           "15m", "warning", "The operator's {{ $labels.kind }} reconciles keep failing",
           "See the ReconcileError condition and Warning Events of the objects, and the operator's log."),
    _alert("LockstepTargetDown",
           'up{job=~"lockstep-.*"} == 0', "5m", "warning",
           "{{ $labels.job }} target {{ $labels.namespace }}/{{ $labels.pod }} down",
           "Prometheus cannot scrape it: the process is not serving its metrics port."),
]  # fmt: skip


def rule_groups() -> dict[str, Any]:
    return {"groups": [{"name": "lockstep.records", "interval": "15s", "rules": RECORDS},
                       {"name": "lockstep.alerts", "rules": ALERTS}]}  # fmt: skip


def prometheus_rule() -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "lockstep", "namespace": "lockstep-system", "labels": {"app.kubernetes.io/part-of": "lockstep"}},
        "spec": rule_groups(),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------- dashboard

SEL = 'namespace=~"$namespace", rljob=~"$rljob"'

PANELS: list[tuple[str, list[tuple[str, str, str, str]]]] = [
    # (row, [(title, unit, expr, legend)])
    ("Training", [
        ("Step", "none", f'lockstep_step{{job="lockstep-driver", {SEL}}}', "{{rljob}}"),
        ("Steps per minute", "none", f'rljob:lockstep_steps_per_minute:deriv5m{{{SEL}}}', "{{rljob}}"),
        ("Time since the last step", "s",
         f'time() - lockstep_last_step_timestamp_seconds{{job="lockstep-driver", {SEL}}}', "{{rljob}}"),
        ("Reward (mean)", "none", f'lockstep_reward_mean{{job="lockstep-driver", {SEL}}}', "{{rljob}}"),
        ("Loss", "none", f'lockstep_loss{{job="lockstep-driver", {SEL}}}', "{{rljob}}"),
        ("Trained tokens per step", "none", f'lockstep_train_tokens{{job="lockstep-driver", {SEL}}}', "{{rljob}}"),
        ("Trained tokens per second", "none",
         f'rljob:lockstep_trained_tokens_per_second:deriv5m{{{SEL}}}', "{{rljob}}"),
        ("Train / rollout log-prob gap", "none",
         f'lockstep_train_rollout_logprob_abs_diff{{job="lockstep-driver", {SEL}}}', "{{rljob}}"),
        ("Step time: train, log-probs", "s",
         f'{{__name__=~"lockstep_time_train_s|lockstep_time_logprobs_s", job="lockstep-driver", {SEL}}}',
         "{{rljob}} {{__name__}}"),
    ]),
    ("Weights", [
        ("Weight sync time", "s", f'lockstep_update_weights_s{{job="lockstep-driver", {SEL}}}', "{{rljob}}"),
        ("Weight version: driver and engines", "none",
         f'lockstep_weight_version{{job="lockstep-driver", {SEL}}} or lockstep_engine_weight_version{{{SEL}}}',
         "{{rljob}} {{pod}}"),
        ("Staleness (fully-async, versions)", "none",
         f'lockstep_staleness_s_old_max{{job="lockstep-driver", {SEL}}}', "{{rljob}} max"),
    ]),
    ("Engines", [
        ("Engines ready (fraction of the pool)", "percentunit",
         f'rljob:lockstep_engines_ready:sum{{{SEL}}} / rljob:lockstep_engines:count{{{SEL}}}', "{{rljob}}"),
        ("Generated tokens per second", "none",
         f'rljob:lockstep_engine_generated_tokens:rate5m{{{SEL}}}', "{{rljob}}"),
        ("Requests per second", "reqps",
         f'sum by (rljob, pod) (rate(lockstep_engine_requests_total{{{SEL}}}[5m]))', "{{pod}}"),
        ("Prefix-cache hit ratio", "percentunit",
         f'sum by (rljob) (rate(lockstep_engine_cached_tokens_total{{{SEL}}}[5m])) / '
         f'sum by (rljob) (rate(lockstep_engine_prompt_tokens_total{{{SEL}}}[5m]))', "{{rljob}}"),
    ]),
    ("SGLang (the engines' own series)", [
        ("Running requests", "none",
         f'sum by (rljob, pod) (sglang:num_running_reqs{{job="lockstep-engine", {SEL}}})', "{{pod}}"),
        ("Queued requests", "none",
         f'sum by (rljob, pod) (sglang:num_queue_reqs{{job="lockstep-engine", {SEL}}})', "{{pod}}"),
        ("Generation throughput (tokens/s)", "none",
         f'sum by (rljob, pod) (rate(sglang:generation_tokens_total{{job="lockstep-engine", {SEL}}}[5m]))',
         "{{pod}}"),
        ("Prompt tokens per second", "none",
         f'sum by (rljob, pod) (rate(sglang:prompt_tokens_total{{job="lockstep-engine", {SEL}}}[5m]))',
         "{{pod}}"),
        ("KV token usage (SGLang)", "percentunit",
         f'max by (rljob, pod) (sglang:token_usage{{job="lockstep-engine", {SEL}}})', "{{pod}}"),
        ("Time to first token p90 (SGLang)", "s",
         'histogram_quantile(0.9, sum by (rljob, le) '
         f'(rate(sglang:time_to_first_token_seconds_bucket{{job="lockstep-engine", {SEL}}}[5m])))', "{{rljob}}"),
    ]),
    ("Trainer", [
        ("Commands per second", "ops",
         f'sum by (rljob, command) (rate(lockstep_trainer_commands_total{{{SEL}}}[5m]))', "{{command}}"),
        ("Command time p90", "s", f'rljob:lockstep_trainer_command_seconds:p90_5m{{{SEL}}}', "{{command}}"),
    ]),
    ("Sessions (agent jobs)", [
        ("Session prompt tokens per second", "none",
         f'sum by (rljob) (rate(tito_prompt_tokens_total{{{SEL}}}[5m]))', "{{rljob}}"),
        ("Session token mismatches", "none",
         f'sum by (rljob, type) (increase(tito_session_mismatch_total{{{SEL}}}[5m]))', "{{type}}"),
    ]),
    ("Operator", [
        ("Reconciles per second", "ops", "kind:lockstep_operator_reconciles:rate5m", "{{kind}} {{result}}"),
        ("Reconcile time p90", "s",
         'histogram_quantile(0.9, sum by (kind, le) (rate(lockstep_operator_reconcile_seconds_bucket[5m])))',
         "{{kind}}"),
        ("Reconciles in flight", "none", "lockstep_operator_reconciles_in_flight", "{{pod}}"),
        ("API requests per second", "reqps",
         "sum by (verb, resource) (rate(lockstep_operator_api_requests_total[5m]))", "{{verb}} {{resource}}"),
        ("Events per second", "ops", "sum by (type, reason) (rate(lockstep_operator_events_total[5m]))",
         "{{type}} {{reason}}"),
    ]),
]  # fmt: skip
"""Every panel's query; docs/monitoring.md. The e2e test evaluates each against a real Prometheus."""


def dashboard() -> dict[str, Any]:
    """Grafana dashboard JSON (schemaVersion 39): rows of time-series panels, a Prometheus data
    source variable and namespace / rljob variables from the driver's series."""
    panels: list[dict[str, Any]] = []
    y = 0
    pid = 1
    for row, items in PANELS:
        panels.append({"type": "row", "id": pid, "title": row, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})  # fmt: skip
        pid += 1
        y += 1
        for i, (title, unit, expr, legend) in enumerate(items):
            panels.append({
                "type": "timeseries", "id": pid, "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "none"}},
                "targets": [{"refId": "A", "expr": expr, "legendFormat": legend,
                             "datasource": {"type": "prometheus", "uid": "${datasource}"}}],
            })  # fmt: skip
            pid += 1
        y += 8 * ((len(items) + 2) // 3)

    def variable(name: str, label: str) -> dict[str, Any]:
        return {"name": name, "label": label, "type": "query", "includeAll": True, "multi": True,
                "allValue": ".*", "current": {}, "refresh": 2, "sort": 1,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": {"query": f"label_values(lockstep_step, {name})", "refId": "vars"},
                "definition": f"label_values(lockstep_step, {name})"}  # fmt: skip

    return {
        "uid": "lockstep-rl", "title": "Lockstep RL jobs", "tags": ["lockstep"], "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "30s", "timezone": "",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            variable("namespace", "Namespace"),
            variable("rljob", "RLJob"),
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }  # fmt: skip


def queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every dashboard panel, with the variables at their "All" value."""
    out = []
    for _, items in PANELS:
        for title, _unit, expr, _legend in items:
            out.append((title, expr.replace("$namespace", ".*").replace("$rljob", ".*")))
    return out


# ------------------------------------------------------------------------------------------- output

HEADER = "# Generated by manifests/monitoring/build.py (edit that, then run it); docs/monitoring.md.\n"


def _yaml(*docs: Any) -> str:
    return HEADER + "---\n".join(yaml.safe_dump(d, sort_keys=False, width=120) for d in docs)


def files() -> dict[str, str]:
    return {
        "podmonitors.yaml": _yaml(*(pod_monitor(r) for r in ROLES)),
        "prometheus.yaml": _yaml(scrape_config()),
        "lockstep.rules.yaml": _yaml(rule_groups()),
        "prometheusrule.yaml": _yaml(prometheus_rule()),
        "grafana-dashboard.json": json.dumps(dashboard(), indent=2) + "\n",
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail when a file differs instead of writing it")
    args = parser.parse_args()
    stale = []
    for name, text in files().items():
        path = HERE / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(
            f"manifests/monitoring: {', '.join(stale)} differ from build.py: run `python manifests/monitoring/build.py`"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
