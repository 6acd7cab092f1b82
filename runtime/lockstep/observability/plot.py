"""The end-of-run PNG: reward and mismatch metrics per step, plus panels other loops add.

Why it exists: one picture answers "did it learn, and did train and rollout agree while it did?".
Panels are data, not code: `DEFAULT_PANELS` lists (title, metric names); the fully-async loop adds its
queue-size and staleness panels by passing `extra_panels` (metric names it logs), and a panel whose
metrics never appear in the file is left out.

Who calls it: lockstep.driver at the end of a run (and fully_async with its extra panels).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lockstep.observability.metrics import read_jsonl

Panel = tuple[str, tuple[str, ...]]
"""(title, metric names) of one subplot; "eval_" prefixed names come from kind="eval" records."""

DEFAULT_PANELS: tuple[Panel, ...] = (
    ("reward", ("reward_mean", "task_reward_mean", "eval_reward_mean", "eval_init_reward_mean")),
    ("OPD log-ratio d_t", ("opd_logratio_mean", "opd_logratio_abs_mean")),
    ("train-rollout logprob |diff|", ("train_rollout_logprob_abs_diff",)),
    ("mismatch ratio m", ("mismatch_ratio_mean", "mismatch_ratio_max", "mismatch_ratio_p99")),
    ("mismatch clipfrac / |m-1| / KL", ("mismatch_clipfrac", "mismatch_abs", "train_rollout_kl")),
)
"""Panels every run gets (eval_init is the eval before the SFT warm start, at step 0)."""

ASYNC_PANELS: tuple[Panel, ...] = (
    ("queue size", ("queue_size",)),
    ("staleness", ("staleness_avg", "staleness_max")),
)
"""Hook for the fully-async loop: pass these (or its own) as extra_panels."""


def plot_metrics(jsonl: Path, out: Path, extra_panels: Sequence[Panel] = ()) -> Path | None:
    """Draw every panel that has data into `out` (PNG); returns the path, or None if no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in read_jsonl(jsonl):
        prefix = "" if row.get("kind") == "train" else f"{row.get('kind')}_"
        for key, value in row.items():
            if key in ("kind", "step") or not isinstance(value, int | float):
                continue
            xs, ys = series.setdefault(prefix + key, ([], []))
            xs.append(int(row["step"]))
            ys.append(float(value))
    panels = [(t, [n for n in names if n in series]) for t, names in (*DEFAULT_PANELS, *extra_panels)]
    panels = [(t, names) for t, names in panels if names]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.4 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, names) in zip(axes[:, 0], panels, strict=True):
        for name in names:
            xs, ys = series[name]
            ax.plot(xs, ys, label=name, marker="." if len(xs) < 30 else None)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
