"""Samples/s of fully-async vs sync training on long-tail workloads, same machine, same run.

Why it exists: the figure of §5: with most trajectories short and a few about 10x longer, a
sync loop waits for the slowest trajectory of every batch and the engine idles while the trainer trains;
fully-async keeps `maxInFlight` trajectories generating and trains on complete groups from the buffer.
Goal: trained samples/s ratio >= 2x at comparable reward. Also printed: the staleness distribution of
the fully-async run (S_old, S_post, delta_gen, token-weighted), coverage and mixed-version ratio.

Setup: the built-in `reverse` task on the built-in tiny model, the reference engine in its own process
and the FSDP trainer in this one (CPU), after an SFT warm start done once and shared by every run, so
rewards are not all zero. Two long tails, each run sync and fully-async with the same manifest except
schedule.mode, the same seed and the same number of steps:
- `tokens`: decode length. A generate plugin (`longtail_generate`) lets one trajectory in LONG_EVERY
  sample past the end-of-turn token up to LONG tokens (the others stop, budget SHORT: ~10x). Its reward
  is the exact match of the text before the first end-of-turn token, like the short ones. This tail costs
  engine compute: on a machine where the engine and the trainer share the same few cores there is no
  idle resource for fully-async to fill, only the decode batch width it keeps up.
- `env`: environment time, the agentic case of §5 (a sandbox that runs the tests). The reward
  plugin (`envtail_reward`) waits ENV_SHORT_S per trajectory, ENV_LONG_S (10x) for one in LONG_EVERY,
  before scoring exactly like the task; the wait is asyncio.sleep, i.e. a sandbox that uses none of
  this machine's cores.
The timed window of each run is the loop, from the initial weight push to the last step's record
(component start, final checkpoint and plot excluded); "steady" starts after step 1.

Run:   .venv/bin/python bench/async_longtail.py --out bench/results
Quick: .venv/bin/python bench/async_longtail.py --steps 4 --sft-steps 5 --tails env
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from lockstep.rollout.generate import single_turn
from lockstep.rollout.plugins import RolloutContext
from lockstep.types import Sample

SHORT = 16
"""Token budget of a normal trajectory (it stops at the end-of-turn token, ~5 tokens for this task)."""
LONG = 160
"""Token budget of a long trajectory, sampled without stopping: ~10x the short budget."""
LONG_EVERY = 8
"""One trajectory in this many is long (chosen by a hash of group and sample index)."""


def is_long(sample: Sample) -> bool:
    return zlib.crc32(f"{sample.group_index}:{sample.index}".encode()) % LONG_EVERY == 0


async def longtail_generate(ctx: RolloutContext, sample: Sample) -> Sample:
    """The default single-turn generate, but one trajectory in LONG_EVERY runs LONG tokens."""
    eos = list(ctx.sampling.stop_token_ids or [])
    if is_long(sample):
        params = ctx.sampling.model_copy(
            update={"max_new_tokens": LONG, "ignore_eos": True, "stop_token_ids": None}
        )
    else:
        params = ctx.sampling.model_copy(update={"max_new_tokens": SHORT})
    sample = await single_turn(replace(ctx, sampling=params), sample)
    ids = sample.response_ids
    cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
    sample.metadata["answer_text"] = ctx.decode(ids[:cut])
    return sample


def longtail_reward(sample: Sample, response: str) -> float:
    """Exact match of the text before the first end-of-turn token (the task's own rule)."""
    return 1.0 if sample.metadata["answer_text"].strip() == str(sample.metadata["answer"]).strip() else 0.0


ENV_SHORT_S = 0.1
"""Environment (sandbox) seconds of a normal trajectory in the `env` tail."""
ENV_LONG_S = 1.0
"""Environment seconds of a long trajectory in the `env` tail (10x)."""


async def envtail_reward(sample: Sample, response: str) -> float:
    """The task's exact-match reward after a sandbox wait; one trajectory in LONG_EVERY waits 10x longer."""
    await asyncio.sleep(ENV_LONG_S if is_long(sample) else ENV_SHORT_S)
    return 1.0 if response.strip() == str(sample.metadata["answer"]).strip() else 0.0


TAILS = {
    "tokens": "  agent: {generateFunction: async_longtail:longtail_generate, rewardFunction: async_longtail:longtail_reward}",
    "env": "  agent: {rewardFunction: async_longtail:envtail_reward}",
}
"""The agent section of each workload (both plugins live in this file)."""

MANIFEST = """
apiVersion: rl.lockstep.dev/v1alpha1
kind: RLJob
metadata:
  name: async-longtail
spec:
  model: {{checkpoint: "{checkpoint}", family: tiny}}
  algorithm:
    samplesPerPrompt: {n}
    batchSize: {batch}
    learningRate: 1.0e-3
    mismatch: {{correction: tis}}
    sftWarmStart: {{steps: {sft_steps}, learningRate: 3.0e-3}}
  rollout:
    engine: reference
    gpusPerEngine: 0
    maxInFlight: {in_flight}
    sampling: {{maxNewTokens: {short}, temperature: 1.0}}
  trainer: {{backend: fsdp, device: cpu, gpusPerNode: 1}}
  schedule: {{mode: {mode}, steps: {steps}}}
  data: {{prompts: "builtin:reverse", seed: 0}}
{agent}
"""


def manifest(mode: str, tail: str, checkpoint: str, args: argparse.Namespace, sft_steps: int = 0) -> Any:
    from lockstep.api import load_manifest

    return load_manifest(
        MANIFEST.format(
            agent=TAILS[tail],
            mode=mode,
            checkpoint=checkpoint,
            sft_steps=sft_steps,
            n=args.n,
            batch=args.batch,
            in_flight=args.max_in_flight,
            short=SHORT,
            steps=args.steps,
        )
    )


def warm_start(args: argparse.Namespace, work: Path) -> Path:
    """SFT warm start once; returns the HF checkpoint both timed runs start from (engines == trainer)."""
    from lockstep.driver import run
    from lockstep.driver.settings import RunOptions

    job = manifest("sync", "env", "builtin:tiny", args, sft_steps=args.sft_steps)
    run(job, work / "warm", RunOptions(steps=1, cache_dir=work / "cache"))
    # The first publish after the warm start (version 0) is a complete HF checkpoint with the tokenizer.
    return work / "warm" / "weights" / "weight_v000000"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def engine_process(checkpoint: Path, threads: int) -> Iterator[str]:
    """`lockstep engine` in its own process (its own interpreter and cores), as a rollout pool would be."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "lockstep", "engine", "--model", str(checkpoint), "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


def timed_run(mode: str, tail: str, checkpoint: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Start the engine, build the components, time the loop, evaluate the final weights, read the metrics."""
    job = manifest(mode, tail, str(checkpoint), args)
    run_dir = work / f"{tail}-{mode}"
    with contextlib.ExitStack() as stack:
        urls = (
            [stack.enter_context(engine_process(checkpoint, args.engine_threads))]
            if args.engine_process
            else []
        )
        return _timed(mode, job, urls, run_dir, args, work)


def _timed(
    mode: str, job: Any, urls: list[str], run_dir: Path, args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    from lockstep.config.driver import run_config
    from lockstep.driver.components import build_components
    from lockstep.driver.fully_async import run_fully_async
    from lockstep.driver.settings import RunOptions
    from lockstep.driver.steps import evaluate
    from lockstep.driver.sync import run_sync
    from lockstep.observability.metrics import read_jsonl

    c = build_components(
        run_config(job, embedded_engines=not urls),
        run_dir,
        RunOptions(cache_dir=work / "cache", engine_urls=tuple(urls), engine_timeout_s=120.0),
    )
    stamps: dict[tuple[str, int], float] = {}
    sink_log = c.metrics.log

    def stamped_log(kind: str, step: int, metrics: Any) -> None:
        stamps[(kind, step)] = time.monotonic()
        sink_log(kind, step, metrics)

    # The timed window: from the initial publish (logged just before the loop starts) to the last step's
    # record; component start, the final checkpoint and the plot are outside it in both modes.
    c.metrics.log = stamped_log  # type: ignore[method-assign,unused-ignore]
    try:
        state = run_fully_async(c) if mode == "fully-async" else run_sync(c)
        final_eval = c.runner.run(evaluate(c)).metrics["reward_mean"]
    finally:
        c.close()
    seconds = stamps[("train", state.step)] - stamps[("update_weights", 0)]
    # Steady state: from the end of step 1 (pipelines filled, first-step allocations done) to the end.
    steady = stamps[("train", state.step)] - stamps[("train", 1)]
    train = read_jsonl(run_dir / "metrics.jsonl", "train")
    samples = sum(args.batch * args.n for _ in train)
    return {
        "mode": mode,
        "tail": run_dir.name.split("-")[0],
        "steps": state.step,
        "seconds": seconds,
        "trained_samples": samples,
        "samples_per_s": samples / seconds,
        "steady_seconds": steady,
        "steady_samples_per_s": (samples - args.batch * args.n) / steady,
        "reward_mean": sum(r["reward_mean"] for r in train) / len(train),
        "final_eval_reward": final_eval,
        "records": train,
    }


def staleness_distribution(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Sum the per-step staleness histograms of the fully-async run."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        for k, v in r.items():
            if "_hist_" in k and v is not None:
                measure, _, value = k.removeprefix("staleness_").partition("_hist_")
                out.setdefault(measure, {})
                out[measure][value] = out[measure].get(value, 0.0) + v
    return {
        m: dict(sorted(h.items(), key=lambda kv: float(kv[0].removeprefix("ge")))) for m, h in out.items()
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="optimizer steps of each timed run")
    p.add_argument("--sft-steps", type=int, default=150, help="SFT warm-start steps (shared by both runs)")
    p.add_argument("--batch", type=int, default=4, help="groups per step")
    p.add_argument("--n", type=int, default=4, help="samples per group")
    p.add_argument("--max-in-flight", type=int, default=32, help="fully-async trajectories in flight")
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the engine from its own process (default) instead of a thread of the driver",
    )
    p.add_argument("--engine-threads", type=int, default=1, help="torch threads of the engine process")
    p.add_argument(
        "--trainer-threads", type=int, default=1, help="torch threads of the trainer (this process)"
    )
    p.add_argument("--tails", type=lambda v: v.split(","), default=["tokens", "env"], help="tokens,env")
    p.add_argument("--verbose", action="store_true", help="also print per-step timings of both runs")
    p.add_argument("--out", type=Path, default=None, help="directory for async_longtail-<date>-cpu.json/.txt")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the manifest names async_longtail:...
    import torch

    torch.set_num_threads(args.trainer_threads)
    work = Path(tempfile.mkdtemp(prefix="async-longtail-"))
    try:
        checkpoint = warm_start(args, work)
        runs = {
            t: {m: timed_run(m, t, checkpoint, args, work) for m in ("sync", "fully-async")}
            for t in args.tails
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = header(args)
    for tail, by_mode in runs.items():
        lines += report(tail, by_mode, args)
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        which = "" if sorted(args.tails) == sorted(TAILS) else "-" + "-".join(args.tails)
        stem = args.out / f"async_longtail-{datetime.date.today()}-cpu{which}"
        stem.with_suffix(".txt").write_text(text + "\n")
        slim = {
            t: {m: {k: v for k, v in r.items() if k != "records"} for m, r in bm.items()}
            for t, bm in runs.items()
        }
        summary = {"runs": slim, "args": {k: str(v) for k, v in vars(args).items()}}
        stem.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def header(args: argparse.Namespace) -> list[str]:
    return [
        f"async_longtail  {datetime.date.today()}  {platform.node()}, CPU ({os.cpu_count()} cores shared with other "
        f"work, load average {os.getloadavg()[0]:.1f} at the end); {args.steps} steps x {args.batch} groups x "
        f"{args.n} samples; maxInFlight {args.max_in_flight}; engine: "
        f"{'its own process' if args.engine_process else 'a thread of the driver'} ({args.engine_threads} torch "
        f"threads), trainer {args.trainer_threads} torch threads; SFT warm start {args.sft_steps} steps",
    ]


def report(tail: str, runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """The figure of one tail: ratio, rewards, staleness distribution of the fully-async run."""
    s, a = runs["sync"], runs["fully-async"]
    ratio = a["samples_per_s"] / s["samples_per_s"]
    steady_ratio = a["steady_samples_per_s"] / s["steady_samples_per_s"]
    what = (
        f"1 in {LONG_EVERY} trajectories decodes {LONG} tokens, the others stop (<= {SHORT})"
        if tail == "tokens"
        else f"1 in {LONG_EVERY} trajectories waits {ENV_LONG_S:g} s in its sandbox, the others {ENV_SHORT_S:g} s"
    )
    lines = [
        "",
        f"tail {tail}: {what}",
        f"{'mode':<12}{'seconds':>9}{'samples/s':>11}{'steady':>9}{'train reward':>14}{'final eval':>12}",
    ]
    for r in (s, a):
        lines.append(
            f"{r['mode']:<12}{r['seconds']:>9.1f}{r['samples_per_s']:>11.2f}{r['steady_samples_per_s']:>9.2f}"
            f"{r['reward_mean']:>14.3f}{r['final_eval_reward']:>12.3f}"
        )
    recs = a["records"]
    mean = {
        k: sum(r.get(f"staleness_{k}_mean", 0.0) for r in recs) / len(recs)
        for k in ("s_old", "s_post", "delta_gen", "token_weighted")
    }
    lines += [
        f"trained samples/s ratio fully-async / sync: {ratio:.2f}x over all steps, {steady_ratio:.2f}x steady "
        "state (steps 2..N); goal >= 2x",
        "fully-async staleness per consumed group (mean over steps): "
        + ", ".join(f"{k} {v:.2f}" for k, v in mean.items()),
        f"  max S_old {max((r.get('staleness_s_old_max', 0.0) for r in recs), default=0.0):.0f}, "
        f"coverage {recs[-1].get('weight_version_sample_coverage', 0.0):.2f}, "
        f"mixed-version groups {sum(r.get('mixed_version_ratio', 0.0) for r in recs) / len(recs):.2f}, "
        f"stale groups dropped {recs[-1].get('stale_groups_filtered', 0.0):.0f}, "
        f"mean queue size {sum(r.get('queue_size', 0.0) for r in recs) / len(recs):.1f} of {recs[-1].get('queue_capacity', 0):.0f}",
    ]
    a["ratio"], a["steady_ratio"] = ratio, steady_ratio
    a["staleness"] = staleness_distribution(recs)
    for measure, hist in a["staleness"].items():
        lines.append(
            f"  {measure:<15} groups per value: " + ", ".join(f"{k}: {v:.0f}" for k, v in hist.items())
        )
    if args.verbose:
        lines += per_step_lines(runs)
    return lines


def per_step_lines(runs: dict[str, dict[str, Any]]) -> list[str]:
    keys = (
        "wait_data_s",
        "train_wall_s",
        "time_train_s",
        "update_weights_wall_s",
        "queue_size",
        "in_flight",
        "reward_mean",
    )
    out = []
    for r in runs.values():
        out.append(f"  per step, {r['mode']:<12}" + "".join(f"{k[:13]:>14}" for k in keys))
        for rec in r["records"]:
            out.append(
                f"  step {rec['step']:>3}{'':>18}" + "".join(f"{(rec.get(k) or 0.0):>14.3f}" for k in keys)
            )
    return out


if __name__ == "__main__":
    sys.exit(main())
