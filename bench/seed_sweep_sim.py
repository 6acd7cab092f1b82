"""A fast stand-in of the example's recipe (`lockstep run examples/tiny-local.yaml`) to try levers per seed.

Why it exists: screening recipes across seeds (bench/seed_sweep.py). A full run takes 3.5-20 minutes on the shared 2 cores, too slow to try many
levers on many seeds. This replays the same recipe in one process without the engine, HTTP or
checkpoints: the same built-in model init per seed (lockstep.models.tiny.builtin_dir), the same task
items (ReverseDigits), the same SFT items (SFT_ITEM_BASE offset, batch x samples rows per step), AdamW
with the backend's betas (0.9, 0.99), grad clip 1.0, GRPO advantages and the token-mean loss. The RL
samples are drawn here (a torch generator per seed), so its RL draws differ from a real run's; its warm
start matches the real one (seed 0 after 85 SFT steps: loss 0.558 vs 0.566, greedy eval 0.42 vs 0.41)
and its end figures track the real sweep (bench/results/seed_sweep_2026-12-03_notes.md). Use it to
choose what to run, then confirm with bench/seed_sweep.py; never quote it as the example's figure.

Levers (flags): warm start (--sft-steps, --sft-lr, --stop-at-loss), --lr, --batch, --n (samples per
prompt), --temp, --reward exact|partial|prefix (partial: 0.5 exact + 0.5 share of matching positions;
prefix: 0.5 exact + 0.5 share of the correct leading characters), --dyn CAP (dynamic sampling), --ent
(entropy bonus), --klsft (k3 KL to the warm-started policy), --adv grpo|ppo (ppo: no std division),
--mb K (K optimizer steps per batch with PPO clipping --eps-lo/--eps-hi), model shape (--hidden,
--layers, --hd, --heads, --kv, --inter), the RL rate's schedule (--warmup, --decay constant|linear|cosine,
--min-lr: spec.algorithm.lrSchedule, through the trainer's own learning_rate_at), --init-seed (the model init of another seed), --probe N (SFT
eval every N steps), length curricula (--sft-min-digits with --sft-long-steps K: SFT on answers of at
least that many digits, for the first K steps when K > 0; --rl-min-digits: RL prompts of at least that
many digits), the built-in model (--model tiny|tiny-deep), LoRA (--lora-rank R > 0: a peft adapter on
the frozen base through the trainer's own lockstep.train.fsdp.lora.attach, seeded as the backend seeds
it, with --lora-alpha and --lora-targets as in spec.model.lora; the optimizer then sees the adapter
alone). Greedy eval by answer length, and where 4/5-digit answers go wrong, every 50 steps.

Run: PYTHONPATH=runtime python bench/seed_sweep_sim.py --seed 7 --sft-steps 400 --stop-at-loss 0.5
     [--batch 16] [--log sims.jsonl]   (one JSON line per run appended to --log)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from typing import Any

import torch
from lockstep.models.tiny import ASSISTANT_ID, CHARS, EOS_ID, USER_ID, builtin_dir, tiny_config
from lockstep.tasks.digits import ReverseDigits
from lockstep.train.common.lr_schedule import LRSchedule, learning_rate_at
from lockstep.train.fsdp import lora
from lockstep.train.fsdp.lora import AdapterConfig
from lockstep.trainer.parts import SFT_ITEM_BASE
from transformers import Qwen3ForCausalLM

Row = tuple[list[int], list[int], float | None]
"""(prompt IDs, response IDs, advantage; None for an SFT row)."""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, kind, default in [
        ("seed", int, 0), ("init-seed", int, None), ("sft-steps", int, 85), ("sft-lr", float, 3e-3),
        ("stop-at-loss", float, None), ("stop-at-prob", float, None), ("steps", int, 500), ("lr", float, 1e-3), ("n", int, 8),
        ("batch", int, 8), ("temp", float, 1.0), ("reward", str, "exact"), ("dyn", int, 0),
        ("ent", float, 0.0), ("klsft", float, 0.0), ("adv", str, "grpo"), ("mb", int, 1),
        ("eps-lo", float, 0.2), ("eps-hi", float, 0.2), ("hidden", int, 0), ("layers", int, 2),
        ("heads", int, 4), ("kv", int, 2), ("hd", int, 16), ("inter", int, 0), ("probe", int, 0),
        ("log", str, None), ("sft-min-digits", int, 3), ("rl-min-digits", int, 3), ("sft-long-steps", int, 0),
        ("warmup", int, 0), ("decay", str, "constant"), ("min-lr", float, 0.0),
        ("model", str, "tiny"), ("lora-rank", int, 0), ("lora-alpha", int, 32),
        ("lora-targets", str, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"),
    ]:  # fmt: skip
        p.add_argument(f"--{name}", type=kind, default=default)
    return p.parse_args()


class Sim:
    """One run: the model, the task, the optimizer and the flags."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        init_seed = a.seed if a.init_seed is None else a.init_seed
        if a.hidden:  # the same init procedure as lockstep.models.tiny.materialize_builtin
            cfg = tiny_config(
                hidden_size=a.hidden, intermediate_size=a.inter or 2 * a.hidden, num_hidden_layers=a.layers,
                num_attention_heads=a.heads, num_key_value_heads=a.kv, head_dim=a.hd,
            )  # fmt: skip
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(init_seed)
                self.model = Qwen3ForCausalLM(cfg)
        else:
            self.model = Qwen3ForCausalLM.from_pretrained(
                str(builtin_dir(f"builtin:{a.model}", seed=init_seed))
            )
        if a.lora_rank:  # as the FSDP backend does it: seed, then peft's adapter on the frozen base
            torch.manual_seed(a.seed)
            adapter = AdapterConfig(
                rank=a.lora_rank,
                alpha=a.lora_alpha,
                target_modules=tuple(a.lora_targets.split(",")),
                name="sim",
            )
            self.model = lora.attach(self.model, adapter)
        self.task = ReverseDigits(a.seed)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=a.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.ref: Any = None
        self.errs: dict[str, Any] = {}
        self._idx: dict[tuple[int, int], list[int]] = {}

    def prompt(self, index: int, split: str = "train", min_digits: int = 3) -> tuple[list[int], str]:
        """The index-th item (train: the index-th of those with >= min_digits digits)."""
        if split == "train" and min_digits > 3:
            index = self._filtered(index, min_digits)
        item = self.task.item(index, split)  # type: ignore[arg-type]
        return [USER_ID, *encode(item.messages[0]["content"]), ASSISTANT_ID], item.answer

    def _filtered(self, index: int, min_digits: int) -> int:
        base = SFT_ITEM_BASE if index >= SFT_ITEM_BASE else 0
        cache = self._idx.setdefault((base, min_digits), [])
        pos = base + (cache[-1] - base + 1 if cache else 0)
        while len(cache) <= index - base:
            if len(self.task.item(pos, "train").answer) >= min_digits:
                cache.append(pos)
            pos += 1
        return cache[index - base]

    def logprobs(self, rows: list[Row], temp: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """Per-token logprobs [B, T-1] of the responses, the loss mask, the advantages, the logits."""
        t = max(len(p) + len(r) for p, r, _ in rows)
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        att = torch.zeros_like(ids)
        mask = torch.zeros(len(rows), t - 1)
        adv = torch.zeros(len(rows), t - 1)
        for i, (p, r, a) in enumerate(rows):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            att[i, : len(p) + len(r)] = 1
            mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1
            value = torch.tensor(a) if isinstance(a, list) else (1.0 if a is None else a)
            adv[i, len(p) - 1 : len(p) - 1 + len(r)] = value
        logits = self.model(input_ids=ids, attention_mask=att).logits[:, :-1].float() / temp
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        return lp, mask, adv, (logits, ids, att)

    def step(self, rows: list[Row], lr: float, old: torch.Tensor | None = None) -> float:
        """One optimizer step: SFT NLL (advantage None) or the policy loss, token mean; returns entropy est."""
        a, rl = self.a, rows[0][2] is not None
        for g in self.opt.param_groups:
            g["lr"] = lr
        lp, mask, adv, (logits, ids, att) = self.logprobs(rows, a.temp if rl else 1.0)
        n = mask.sum()
        if rl and old is not None:
            ratio = torch.exp(lp - old)
            pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - a.eps_lo, 1 + a.eps_hi))
            loss = (pg * mask).sum() / n
        else:
            loss = -(lp * adv * mask).sum() / n
        if rl and a.ent > 0:
            logp_all = torch.log_softmax(logits, -1)
            loss = loss - a.ent * ((-(logp_all.exp() * logp_all).sum(-1)) * mask).sum() / n
        if rl and a.klsft > 0:
            with torch.no_grad():
                ref = torch.log_softmax(
                    self.ref(input_ids=ids, attention_mask=att).logits[:, :-1].float() / a.temp, -1
                )
                ref_lp = ref.gather(-1, ids[:, 1:, None])[..., 0]
            d = ref_lp - lp
            loss = loss + a.klsft * ((torch.exp(d) - d - 1) * mask).sum() / n
        self.opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], 1.0)
        self.opt.step()
        self.last_loss = float(loss.detach())
        # The probability of the whole reference answer per SFT row: the expected exact-match reward at T=1.
        self.last_prob = float(torch.exp((lp.detach() * mask).sum(-1)).mean())
        return float((-lp.detach() * mask).sum() / n)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], temp: float, gen: torch.Generator | None = None
    ) -> list[list[int]]:
        """Responses (the end-of-turn token included when sampled), at most 6 tokens, prompts bucketed by length."""
        out: list[list[int]] = [[] for _ in prompts]
        buckets: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            buckets.setdefault(len(p), []).append(i)
        for idx in buckets.values():
            x = torch.tensor([prompts[i] for i in idx])
            done = [False] * len(idx)
            for _ in range(6):
                lg = self.model(input_ids=x).logits[:, -1].float()
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
                x = torch.cat([x, nxt[:, None]], 1)
        return out

    def evaluate(self) -> tuple[float, dict[int, float]]:
        """Greedy exact match on the eval split, by answer length; records where 4/5-digit answers go wrong."""
        items = [self.prompt(i, "eval") for i in range(self.task.eval_size)]
        resps = self.generate([p for p, _ in items], 0)
        by: dict[int, list[bool]] = {3: [], 4: [], 5: []}
        errs: dict[str, Any] = {"short": 0, "long": 0, "position": [0] * 6}
        for (_, ans), r in zip(items, resps, strict=True):
            text = decode(r)
            by[len(ans)].append(text == ans)
            if len(ans) >= 4 and text != ans:
                if len(text) != len(ans):
                    errs["short" if len(text) < len(ans) else "long"] += 1
                else:
                    for k, (x, y) in enumerate(zip(text, ans, strict=True)):
                        errs["position"][k] += x != y
        self.errs = errs
        total = sum(sum(v) for v in by.values()) / len(items)
        return total, {k: round(sum(v) / max(len(v), 1), 2) for k, v in by.items()}

    def reward(self, resp: list[int], ans: str) -> tuple[float, float]:
        """(training reward, exact match) of one response."""
        text = decode(resp)
        exact = 1.0 if text.strip() == ans else 0.0
        if self.a.reward in ("exact", "token"):
            return exact, exact
        if self.a.reward == "partial":
            hits = sum(x == y for x, y in zip(text, ans, strict=False))
        elif self.a.reward == "prefix":
            hits = next(
                (k for k, (x, y) in enumerate(zip(text, ans, strict=False)) if x != y),
                min(len(text), len(ans)),
            )
        else:
            raise SystemExit(f"--reward: unknown {self.a.reward!r}; use exact, partial or prefix")
        return 0.5 * exact + 0.5 * hits / max(len(text), len(ans)), exact


def encode(text: str) -> list[int]:
    return [6 + CHARS.index(c) for c in text]


def decode(ids: list[int]) -> str:
    out = []
    for t in ids:
        if t == EOS_ID:
            break
        if 6 <= t < 6 + len(CHARS):
            out.append(CHARS[t - 6])
    return "".join(out)


def warm_start(sim: Sim) -> int:
    a, losses, probs = sim.a, [], []
    rows_per_step = a.batch * a.n
    for k in range(a.sft_steps):
        rows: list[Row] = []
        for j in range(rows_per_step):
            p, ans = sim.prompt(
                SFT_ITEM_BASE + k * rows_per_step + j,
                min_digits=a.sft_min_digits if (k < a.sft_long_steps or not a.sft_long_steps) else 3,
            )
            rows.append((p, [*encode(ans), EOS_ID], None))
        sim.step(rows, a.sft_lr)
        losses.append(sim.last_loss)
        probs.append(sim.last_prob)
        if a.probe and (k + 1) % a.probe == 0:
            print(f"SFT {k + 1} loss5 {sum(losses[-5:]) / 5:.3f} eval {sim.evaluate()}", flush=True)
        if a.stop_at_loss and len(losses) >= 5 and sum(losses[-5:]) / 5 <= a.stop_at_loss:
            break
        if a.stop_at_prob and len(probs) >= 5 and sum(probs[-5:]) / 5 >= a.stop_at_prob:
            break
    return len(losses)


def collect(sim: Sim, consumed: int, gen: torch.Generator) -> tuple[list[Any], list[float], int, int]:
    """One step's groups (dynamic sampling drops groups without a spread, within --dyn), every sample's
    exact match, the data position and the groups generated."""
    a, groups, exact, generated = sim.a, [], [], 0
    while True:
        need = a.batch - len(groups)
        items = [sim.prompt(consumed + i, min_digits=a.rl_min_digits) for i in range(need)]
        consumed, generated = consumed + need, generated + need
        resps = sim.generate([p for p, _ in items for _ in range(a.n)], a.temp, gen)
        for g, (p, ans) in enumerate(items):
            rs = resps[g * a.n : (g + 1) * a.n]
            scored = [sim.reward(r, ans) for r in rs]
            exact += [s[1] for s in scored]
            rewards = [s[0] for s in scored]
            if a.dyn and max(rewards) - min(rewards) < 1e-9:
                continue
            groups.append((p, rs, rewards, [*encode(ans), EOS_ID]))
        if not a.dyn or len(groups) >= a.batch or generated >= a.dyn:
            return groups[: a.batch], exact, consumed, generated


def token_rows(groups: list[Any]) -> list[Any]:
    """--reward token: a per-token advantage, the token's credit (1 while the answer so far, this token
    included, matches the reference, end-of-turn token included) normalised per position over the group."""
    rows = []
    for p, rs, _, target in groups:
        credit = [
            [
                float(all(x == y for x, y in zip(r[: t + 1], target, strict=False)) and t < len(target))
                for t in range(len(r))
            ]
            for r in rs
        ]
        for r, c in zip(rs, credit, strict=True):
            advs = []
            for t in range(len(r)):
                col = [cc[t] for cc in credit if len(cc) > t]
                mean = sum(col) / len(col)
                std = math.sqrt(sum((x - mean) ** 2 for x in col) / len(col))
                advs.append((c[t] - mean) / (std + 1e-6))
            rows.append((p, r, advs))
    return rows


def train(sim: Sim, groups: list[Any], lr: float) -> float:
    a, rows = sim.a, []
    if a.reward == "token":
        return sim.step(token_rows(groups), lr)
    for p, rs, rewards, _ in groups:
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
        rows += [
            (p, r, (x - mean) / (std + 1e-6) if a.adv == "grpo" else x - mean)
            for r, x in zip(rs, rewards, strict=True)
        ]
    if a.mb == 1:
        return sim.step(rows, lr)
    per = len(rows) // a.mb
    chunks = [rows[i : i + per] for i in range(0, len(rows), per)]
    with torch.no_grad():
        olds = [sim.logprobs(c, a.temp)[0] for c in chunks]
    ent = 0.0
    for c, old in zip(chunks, olds, strict=True):
        ent = sim.step(c, lr, old)
    return ent


def main() -> None:
    a = parse()
    torch.set_num_threads(1)
    sim = Sim(a)
    t0 = time.time()
    sft_steps = warm_start(sim)
    eval_sft = sim.evaluate()
    print("   errors on 4/5 digits", sim.errs, flush=True)
    print(
        f"seed {a.seed} sft steps {sft_steps} loss {sim.last_loss:.3f} answer prob {sim.last_prob:.3f} eval {eval_sft}",
        flush=True,
    )
    if a.steps == 0:
        sys.exit(0)
    if a.klsft > 0:
        sim.ref = copy.deepcopy(sim.model).eval()
    gen = torch.Generator().manual_seed(a.seed)
    consumed, rewards, evals = 0, [], {0: eval_sft[0]}
    # the RL rate per step: the trainer's own schedule function (spec.algorithm.lrSchedule)
    schedule = LRSchedule(a.lr, a.steps, a.warmup, a.decay, a.min_lr)  # type: ignore[arg-type]
    for step in range(1, a.steps + 1):
        groups, exact, consumed, generated = collect(sim, consumed, gen)
        lr = learning_rate_at(schedule, step)
        ent = train(sim, groups, lr) if groups else float("nan")
        rewards.append(sum(exact) / len(exact))
        if step % 50 == 0 or step == a.steps:
            ev = sim.evaluate()
            evals[step] = ev[0]
            print("   errors on 4/5 digits", sim.errs, flush=True)
            print(
                f"  step {step} r50 {sum(rewards[-50:]) / 50:.2f} ent {ent:.2f} gen {generated} eval {ev}",
                flush=True,
            )
    res = {
        "seed": a.seed, "first5": sum(rewards[:5]) / 5, "last10": sum(rewards[-10:]) / 10,
        "eval_end": evals[max(evals)], "eval_sft": eval_sft[0], "sft_steps": sft_steps,
        "wall": time.time() - t0, "args": vars(a),
    }  # fmt: skip
    print("RESULT", json.dumps(res), flush=True)
    if a.log:
        with open(a.log, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
