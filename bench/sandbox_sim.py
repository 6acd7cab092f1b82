"""A fast stand-in of `lockstep run examples/tiny-sandbox.yaml` to screen recipes per seed.

Why it exists: a full run of the sandbox example takes 5-45 minutes on the shared 2 cores, too slow
to try many levers on many seeds. This replays the recipe in one process without the engine, the
session server, HTTP or checkpoints: the same built-in model init per seed (builtin_dir), the same
task items (lockstep.tasks.shell.suite, SFT items from SFT_ITEM_BASE), the SFT pairs through the
tiny chat template (ChatTokenizer.reply_pair), AdamW with the backend's betas and clip, GRPO
advantages and the token-mean loss. Sampling is here (a torch generator per seed, KV cache), so its
RL draws differ from a real run's. Every reply is parsed by the tiny family (as the session server
does; a reply cut at maxNewTokens runs no command) and scored by the task's test script in a real
local sandbox (lockstep.sandbox.local: Landlock), memoized per (setup, command, test). Use it to choose
what to run, then confirm with bench/seed_sweep.py; never quote it as the example's figure.

The RL learning rate follows spec.algorithm.lrSchedule's function (lockstep.train.common.lr_schedule):
--warmup W --decay constant|linear|cosine --min-lr M over --steps, peak --lr (default constant).
--max-groups G is algorithm.dynamicSampling.maxGroupsPerStep (0: off); the sampled reward it reports
is over every generated episode, as the driver logs it.

Run: PYTHONPATH=runtime python bench/sandbox_sim.py --seed 0 [--steps 150 --lr 1e-3 --stop-at-loss 0.02]
     [--decay cosine --min-lr 1e-4] [--max-groups 24] [--log sims.jsonl]   (one JSON line per run appended to --log)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from lockstep.models.families.tiny import build as tiny_family
from lockstep.models.tiny import EOS_ID, builtin_dir, chat_tokenizer
from lockstep.rollout.group_signal import groups_to_generate, has_signal
from lockstep.sandbox.base import SandboxConfig
from lockstep.sandbox.local import LocalSandboxProvider
from lockstep.tasks.shell import SH_TOOL
from lockstep.tasks.shell.suite import ShellSuite
from lockstep.train.common.lr_schedule import LRSchedule, learning_rate_at
from lockstep.trainer.parts import SFT_ITEM_BASE
from transformers import Qwen3ForCausalLM

Row = tuple[list[int], list[int], float | None]
"""(prompt IDs, response IDs, advantage; None for an SFT row)."""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, kind, default in [
        ("seed", int, 0), ("model", str, "builtin:tiny-deep"), ("sft-steps", int, 400),
        ("sft-lr", float, 3e-3), ("stop-at-loss", float, 0.02), ("steps", int, 40), ("lr", float, 3e-4),
        ("n", int, 8), ("batch", int, 8), ("temp", float, 1.0), ("max-tokens", int, 64),
        ("log", str, None), ("every", int, 10), ("sft-cache", str, None), ("letters", str, ""),
        ("digits", str, ""), ("kinds", str, ""), ("warmup", int, 0), ("decay", str, "constant"),
        ("min-lr", float, 0.0), ("max-groups", int, 0),
    ]:  # fmt: skip
        p.add_argument(f"--{name}", type=kind, default=default)
    return p.parse_args()


class Scorer:
    """The task's test script's verdict on one command, run in a real local sandbox (memoized)."""

    def __init__(self) -> None:
        cfg = SandboxConfig(image="local", command_timeout_s=5.0, output_limit=512, memory_bytes=256 << 20,
                            disk_bytes=16 << 20)  # fmt: skip
        self.provider = LocalSandboxProvider(cfg, max_sandboxes=16)
        self.memo: dict[tuple[Any, ...], float] = {}
        self.loop = asyncio.new_event_loop()

    async def _one(self, setup: str | None, cmd: str | None, test: str) -> float:
        async with self.provider.claim("sim") as box:
            if setup:
                await box.exec(setup)
            if cmd:
                await box.exec(cmd)
            return 1.0 if (await box.exec(test)).exit_code == 0 else 0.0

    async def _all(self, todo: list[tuple[str | None, str | None, str]]) -> list[float]:
        return list(await asyncio.gather(*(self._one(*j) for j in todo)))

    def score(self, jobs: list[tuple[str | None, str | None, str]]) -> list[float]:
        todo = sorted({j for j in jobs if j not in self.memo}, key=str)
        if todo:
            got = self.loop.run_until_complete(self._all(todo))
            self.memo.update(zip(todo, got, strict=True))
        return [self.memo[j] for j in jobs]


def narrow_suite(letters: str, digits: str, kinds: str) -> None:
    """Screen a narrower builtin:shell: names from `letters`, numbers from `digits`, only `kinds`
    (comma-separated); empty keeps the suite's own."""
    import random

    from lockstep.tasks.shell import suite

    if not (letters or digits or kinds):
        return
    letters = letters or suite.LETTERS
    chosen = sorted(kinds.split(",")) if kinds else sorted(suite.KINDS)

    def task(seed: int, split: Any, index: int) -> Any:
        rng = random.Random(f"shell:{seed}:{split}:{index}")
        while True:
            kind = rng.choice(chosen)
            a, b = rng.sample(letters, 2)
            n = rng.choice(digits) if digits else str(rng.randint(1, 9))
            spec = suite.KINDS[kind](a, b, n)
            if suite._is_eval(spec[0]) == (split == "eval"):
                return kind, spec

    suite.task = task


class Sim:
    """One run: the model, the suite, the optimizer, the scorer."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        narrow_suite(a.letters, a.digits, a.kinds)
        self.model = Qwen3ForCausalLM.from_pretrained(str(builtin_dir(a.model, seed=a.seed)))
        self.suite = ShellSuite(a.seed)
        self.chat = chat_tokenizer()
        self.family = tiny_family()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=a.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.scorer = Scorer()
        self.cursor = 0

    def sft_row(self, index: int) -> Row:
        item = self.suite.item(index)
        prompt, answer = self.chat.reply_pair(item.messages, item.metadata["reference_reply"], [SH_TOOL])
        return prompt, [*answer, EOS_ID], None

    def step(self, rows: list[Row], lr: float, temp: float = 1.0) -> float:
        """One optimizer step, token mean (SFT: NLL; RL: -A log p); returns the loss. `temp`: the
        logprobs are of softmax(logits / temp), as the trainer's at the rollout temperature (SFT: 1)."""
        for g in self.opt.param_groups:
            g["lr"] = lr
        t = max(len(p) + len(r) for p, r, _ in rows)
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        att = torch.zeros_like(ids)
        mask = torch.zeros(len(rows), t - 1)
        adv = torch.zeros(len(rows), t - 1)
        for i, (p, r, a) in enumerate(rows):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            att[i, : len(p) + len(r)] = 1
            mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1
            adv[i, len(p) - 1 : len(p) - 1 + len(r)] = 1.0 if a is None else a
        logits = self.model(input_ids=ids, attention_mask=att).logits[:, :-1].float() / temp
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(lp * adv * mask).sum() / mask.sum()
        self.opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.entropy = float((-lp.detach() * mask).sum() / mask.sum())
        return float(loss.detach())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], temp: float, gen: torch.Generator | None) -> list[list[int]]:
        """Responses (with the end-of-turn token when sampled), prompts bucketed by length, KV cache."""
        out: list[list[int]] = [[] for _ in prompts]
        buckets: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            buckets.setdefault(len(p), []).append(i)
        for idx in buckets.values():
            x = torch.tensor([prompts[i] for i in idx])
            done = [False] * len(idx)
            past = None
            for _ in range(self.a.max_tokens):
                o = self.model(input_ids=x, past_key_values=past, use_cache=True)
                past = o.past_key_values
                lg = o.logits[:, -1].float()
                nxt = (
                    lg.argmax(-1)
                    if temp == 0
                    else torch.multinomial(torch.softmax(lg / temp, -1), 1, generator=gen)[:, 0]
                )
                for j, i in enumerate(idx):
                    if not done[j]:
                        out[i].append(int(nxt[j]))
                        done[j] = int(nxt[j]) == EOS_ID
                if all(done):
                    break
                x = nxt[:, None]
        return out

    def command(self, resp: list[int]) -> str | None:
        """The `sh` command of a reply, as the terminal agent would run it (None: no command ran)."""
        if not resp or resp[-1] != EOS_ID:
            return None  # cut at maxNewTokens: the agent runs nothing
        parsed = self.family.parse_reply(self.chat.decode(resp))
        for call in parsed.tool_calls[:1]:
            try:
                args = json.loads(call.arguments or "{}")
            except ValueError:
                return None
            cmd = args.get("cmd") if isinstance(args, dict) and call.name == "sh" else None
            return cmd if isinstance(cmd, str) and cmd.strip() else None
        return None

    def rewards(self, items: list[Any], resps: list[list[int]]) -> list[float]:
        jobs = []
        for it, r in zip(items, resps, strict=True):
            m = it.metadata
            jobs.append((m.get("setup"), self.command(r), str(m["test"])))
        return self.scorer.score(jobs)

    def evaluate(self) -> float:
        items = [self.suite.item(i, "eval") for i in range(self.suite.eval_size)]
        prompts = [self.chat.render(it.messages, True, [SH_TOOL]) for it in items]
        rs = self.rewards(items, self.generate(prompts, 0, None))
        return sum(rs) / len(rs)


def warm_start(sim: Sim) -> int:
    a, losses, rows_per_step = sim.a, [], sim.a.batch * sim.a.n
    for k in range(a.sft_steps):
        rows = [sim.sft_row(SFT_ITEM_BASE + k * rows_per_step + j) for j in range(rows_per_step)]
        losses.append(sim.step(rows, a.sft_lr))
        if a.stop_at_loss and len(losses) >= 5 and sum(losses[-5:]) / 5 <= a.stop_at_loss:
            break
    return len(losses)


def warm_start_cached(sim: Sim) -> int:
    """warm_start, or its saved result (weights and optimizer state, which RL continues from as the
    trainer's does) for the same model, seed, SFT settings and narrowed suite under --sft-cache."""
    a = sim.a
    if not a.sft_cache:
        return warm_start(sim)
    suite = f"-{a.letters}-{a.digits}-{a.kinds.replace(',', '+')}" if a.letters or a.digits or a.kinds else ""
    path = (
        Path(a.sft_cache)
        / f"{a.model.replace(':', '_')}-s{a.seed}-{a.sft_lr}-{a.stop_at_loss}-{a.sft_steps}{suite}.pt"
    )
    if path.exists():
        saved = torch.load(path)
        sim.model.load_state_dict(saved["model"])
        sim.opt.load_state_dict(saved["opt"])
        return int(saved["steps"])
    steps = warm_start(sim)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": sim.model.state_dict(), "opt": sim.opt.state_dict(), "steps": steps}, path)
    return steps


Group = tuple[list[int], list[list[int]], list[float]]
"""(prompt IDs, the n responses, their rewards) of one task."""


def groups(sim: Sim, count: int, gen: torch.Generator) -> list[Group]:
    """`count` groups of the next train items (advances sim.cursor, the data position)."""
    a = sim.a
    items = [sim.suite.item(sim.cursor + g) for g in range(count)]
    sim.cursor += count
    prompts = [sim.chat.render(it.messages, True, [SH_TOOL]) for it in items]
    resps = sim.generate([p for p in prompts for _ in range(a.n)], a.temp, gen)
    rewards = sim.rewards([it for it in items for _ in range(a.n)], resps)
    return [
        (p, resps[g * a.n : (g + 1) * a.n], rewards[g * a.n : (g + 1) * a.n]) for g, p in enumerate(prompts)
    ]


def rl_step(sim: Sim, gen: torch.Generator, lr: float) -> tuple[float, float, int]:
    """One RL step on batch x n episodes at rate `lr`: (mean reward of every generated episode, share
    of zero-variance groups among them, groups generated). With --max-groups (the manifest's
    algorithm.dynamicSampling.maxGroupsPerStep) groups without a reward spread are dropped and more
    generated within the cap, as lockstep.driver.steps.collect_batch does."""
    a = sim.a
    made = groups(sim, a.batch, gen)
    if a.max_groups:
        while k := groups_to_generate(sum(has_signal(g[2]) for g in made), len(made), a.batch, a.max_groups):
            made += groups(sim, k, gen)
        train = ([g for g in made if has_signal(g[2])] or made)[: a.batch]
    else:
        train = made
    rows: list[Row] = []
    for p, resps, rs in train:
        mean = sum(rs) / a.n
        std = math.sqrt(sum((x - mean) ** 2 for x in rs) / a.n)
        rows += [(p, r, (x - mean) / (std + 1e-6)) for r, x in zip(resps, rs, strict=True)]
    sim.step(rows, lr, a.temp)
    rewards = [x for g in made for x in g[2]]
    flat = sum(not has_signal(g[2]) for g in made)
    return sum(rewards) / len(rewards), flat / len(made), len(made)


def main() -> None:
    a = parse()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    sim = Sim(a)
    t0 = time.time()
    sft_steps = warm_start_cached(sim)
    eval_sft = sim.evaluate()
    print(
        f"seed {a.seed} sft steps {sft_steps} eval(greedy) {eval_sft:.2f} {time.time() - t0:.0f}s", flush=True
    )
    gen = torch.Generator().manual_seed(a.seed)
    sched = LRSchedule(a.lr, a.steps, a.warmup, a.decay, a.min_lr)
    rewards: list[float] = []
    flats: list[float] = []
    generated = 0
    for step in range(1, a.steps + 1):
        r, flat, made = rl_step(sim, gen, learning_rate_at(sched, step))
        rewards.append(r)
        flats.append(flat)
        generated += made
        if step % a.every == 0 or step == a.steps:
            k = a.every
            print(
                f"  step {step} r{k} {sum(rewards[-k:]) / k:.2f} flat {sum(flats[-k:]) / k:.2f} "
                f"ent {sim.entropy:.3f} lr {learning_rate_at(sched, step):.1e} {time.time() - t0:.0f}s",
                flush=True,
            )
    res = {
        "seed": a.seed, "first5": sum(rewards[:5]) / 5, "last10": sum(rewards[-10:]) / 10,
        "eval_sft": eval_sft, "eval_end": sim.evaluate(), "sft_steps": sft_steps,
        "wall": time.time() - t0, "groups_generated": generated, "args": vars(a),
    }  # fmt: skip
    print("RESULT", json.dumps(res), flush=True)
    if a.log:
        with open(a.log, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
