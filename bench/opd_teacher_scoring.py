"""Teacher scoring throughput (tokens/s) against the student's generation, on the reference engine.

Why it exists: on-policy distillation (docs/distillation.md) adds one teacher pass per sample; the figure
says what it costs next to generating the sample. Two reference engines of the same model run on
127.0.0.1 (the student and a teacher, as `lockstep run` starts them): the student generates `--samples`
rows of `--tokens` tokens each (concurrently, ignore_eos), then the teacher scores exactly those rows
through SGLang's scoring request (max_new_tokens 0 from the last prompt token; EngineClient.score) three
ways, each from a cold prefix cache: the sampled token only, with the teacher's top-K, with K listed IDs
per row. Everything is repeated `--repeats` times, interleaved, and the medians are printed. Printed: generated tokens/s of the student (the baseline of the same run), scored
response tokens/s of each way, their ratio to generation, and the reply bytes per scored token.

Run: PYTHONPATH=runtime python bench/opd_teacher_scoring.py --out bench/results
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import tempfile
import time
from pathlib import Path

from lockstep.driver.engines import start_reference_engine
from lockstep.models.tiny import chat_tokenizer, materialize_builtin
from lockstep.serving import EngineClient, SamplingParams


async def _generate(
    client: EngineClient, prompts: list[list[int]], tokens: int
) -> tuple[list[list[int]], float]:
    sp = [SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True, sampling_seed=i)
          for i in range(len(prompts))]  # fmt: skip
    t0 = time.perf_counter()
    results = await asyncio.gather(*(client.generate(p, s) for p, s in zip(prompts, sp, strict=True)))
    seconds = time.perf_counter() - t0
    return [p + r.output_ids for p, r in zip(prompts, results, strict=True)], seconds


async def _score(
    client: EngineClient, rows: list[list[int]], starts: list[int], top_k: int, ids: int
) -> tuple[float, int]:
    t0 = time.perf_counter()
    scored = await asyncio.gather(
        *(client.score(r, s, top_k=top_k, token_ids=list(range(10, 10 + ids)) or None)
          for r, s in zip(rows, starts, strict=True))
    )  # fmt: skip
    return time.perf_counter() - t0, sum(x.reply_bytes for x in scored)


async def run(model: str, samples: int, tokens: int, k: int, repeats: int) -> list[str]:
    tmp = Path(tempfile.mkdtemp())
    path = materialize_builtin(model, tmp / "model", seed=0)
    tok = chat_tokenizer()
    student, teacher = start_reference_engine(path), start_reference_engine(path)
    lines = []
    try:
        async with EngineClient(student.url) as s, EngineClient(teacher.url) as t:
            prompts = [
                tok.render([{"role": "user", "content": f"rev {1000 + 7 * i}"}], True) for i in range(samples)
            ]
            await s.generate(prompts[0], SamplingParams(max_new_tokens=2))  # warm up both engines
            await t.score(prompts[0] + [6, 7], len(prompts[0]) - 1)
            ways = [
                ("teacher: sampled token", 0, 0),
                (f"teacher: top-{k}", k, 0),
                (f"teacher: {k} listed IDs", 0, k),
            ]
            gen_times: list[float] = []
            times: dict[str, list[float]] = {name: [] for name, _, _ in ways}
            nbytes: dict[str, int] = {}
            for _ in range(repeats):  # interleaved, medians: the machine's load hits every way alike
                rows, gen_s = await _generate(s, prompts, tokens)
                gen_times.append(gen_s)
                await t.flush_cache()  # every scoring pass starts cold (no prefix of the row cached)
                for name, top_k, ids in ways:
                    secs, size = await _score(t, rows, [len(p) - 1 for p in prompts], top_k, ids)
                    await t.flush_cache()
                    times[name].append(secs)
                    nbytes[name] = size
            n = samples * tokens
            gen_rate = n / statistics.median(gen_times)
            lines.append(
                f"model {model}, {samples} rows x {tokens} response tokens, prompt {len(prompts[0])} tokens; "
                f"median of {repeats} interleaved repetitions"
            )
            lines.append("| way | seconds | response tokens/s | vs generation | reply bytes / token |")
            lines.append("| --- | --- | --- | --- | --- |")
            lines.append(
                f"| student generation (baseline) | {statistics.median(gen_times):.2f} | {gen_rate:.0f} | 1.00x | |"
            )
            for name, _, _ in ways:
                secs = statistics.median(times[name])
                rate = n / secs
                lines.append(
                    f"| {name} | {secs:.2f} | {rate:.0f} | {rate / gen_rate:.2f}x | {nbytes[name] / n:.0f} |"
                )
    finally:
        student.stop()
        teacher.stop()
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny-deep")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lines = asyncio.run(run(args.model, args.samples, args.tokens, args.k, args.repeats))
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        day = datetime.date.today().isoformat()
        out = args.out / f"opd_teacher_scoring_{day}_cpu.md"
        header = ("# Teacher scoring vs student generation (reference engine, CPU)\n\n"
                  "`PYTHONPATH=runtime python bench/opd_teacher_scoring.py --out bench/results`\n\n")  # fmt: skip
        out.write_text(header + text + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
