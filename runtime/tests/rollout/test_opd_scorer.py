"""The teacher scorer against real reference engines on 127.0.0.1 (docs/distillation.md).

A student engine samples; teachers score the sample's exact IDs through EngineClient.score:
- a teacher that is the student (same checkpoint, its own engine) gives the student's own logprob of
  every sampled token: d_t == 0 on every token, exactly when both run the true on-policy kernels;
- a different teacher gives, token by token, the sign of log p - log q that independent HF forwards
  of the two models give (the seed's worked example: d_t > 0 where the student over-rates the token);
- routing: samples labelled for two teachers reach each, counted per teacher; an unrouted label stops
  the run naming it;
- candidate sets served by both engines equal the closed form computed from HF forwards (with K the
  whole vocabulary and student weights: the exact reverse KL);
- the tokenizer check passes for the same tokenizer and names the first differing ID otherwise.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestServer
from lockstep.engine import ReferenceEngine, create_app
from lockstep.models.tiny import chat_tokenizer, materialize_builtin
from lockstep.rollout.opd.config import OPDConfig, UnroutedLabel
from lockstep.rollout.opd.scorer import ScoringPool, TeacherScorer
from lockstep.rollout.opd.tokenizers import TokenizerMismatch, check_same_tokenizer
from lockstep.serving import EngineClient, SamplingParams
from lockstep.types import Sample
from transformers import Qwen3ForCausalLM

TOK = chat_tokenizer()
VOCAB = 92


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("opd")
    student = materialize_builtin("builtin:tiny", root / "student", seed=0)
    other = materialize_builtin("builtin:tiny", root / "other", seed=1)
    # Same weights, a tokenizer that reads IDs 9 and 10 as each other's digit.
    swapped = root / "swapped"
    shutil.copytree(student, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["3"], vocab["4"] = vocab["4"], vocab["3"]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    return {"student": student, "other": other, "swapped": swapped}


@pytest.fixture
async def clients(
    ckpts: dict[str, Path], request: pytest.FixtureRequest
) -> AsyncIterator[dict[str, EngineClient]]:
    exact = getattr(request, "param", False)  # the true on-policy kernels on every engine
    async with AsyncExitStack() as stack:
        out = {}
        for name, path in [("student", ckpts["student"]), ("same", ckpts["student"]), ("other", ckpts["other"]),
                           ("swapped", ckpts["swapped"])]:  # fmt: skip
            engine = ReferenceEngine.load(
                path, max_running_requests=8, context_length=256, seed=0, true_on_policy=exact
            )
            server = TestServer(create_app(engine, stock=True), host="127.0.0.1")
            await server.start_server()
            stack.push_async_callback(server.close)
            client = EngineClient(str(server.make_url("")).rstrip("/"), retries=2, backoff_s=0.01)
            stack.push_async_callback(client.aclose)
            out[name] = client
        yield out


def _config(**kw: Any) -> OPDConfig:
    base: dict[str, Any] = dict(
        teachers=("t",), routes={}, default_teacher="t", label_key="label", zero_task_reward=False,
        candidate_set="sampled", top_k=4, weight="student",
    )  # fmt: skip
    return OPDConfig(**(base | kw))


async def _sample(client: EngineClient, text: str, seed: int, label: str | None = None) -> Sample:
    prompt = TOK.render([{"role": "user", "content": text}], add_generation_prompt=True)
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=seed, ignore_eos=True)
    res = await client.generate(prompt, sp)
    n = len(res.output_ids)
    meta = {"label": label} if label is not None else {}
    return Sample(0, seed, prompt, list(res.output_ids), [1] * n, list(res.output_logprobs), [0] * n,
                  reward=1.0, metadata=meta)  # fmt: skip


def _hf_logp(path: Path, ids: list[int]) -> torch.Tensor:
    model: Any = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]


@pytest.mark.parametrize("clients", [False, True], ids=["default-kernels", "true-on-policy"], indirect=True)
async def test_a_teacher_that_is_the_student_gives_zero_on_every_token(
    clients: dict[str, EngineClient], request: pytest.FixtureRequest
) -> None:
    exact = "true-on-policy" in request.node.name
    scorer = TeacherScorer(config=_config(), teachers={"t": ScoringPool("t", [clients["same"]])})
    for seed in range(3):
        sample = await scorer(await _sample(clients["student"], "rev 4821", seed))
        assert sample.teacher == "t" and sample.teacher_logprobs is not None
        d = [p - q for p, q in zip(sample.rollout_logprobs, sample.teacher_logprobs, strict=True)]
        if exact:
            assert d == [0.0] * len(d)  # bit for bit: decode and scoring prefill run the same kernels
        else:
            # decode and scoring prefill run different kernels: close, and not exactly equal (so the
            # exact zero above is the true on-policy kernels' doing, not a coincidence of this model)
            assert 0 < max(map(abs, d)) < 1e-5, d


async def test_a_different_teacher_gives_the_sign_the_worked_example_predicts(
    clients: dict[str, EngineClient], ckpts: dict[str, Path]
) -> None:
    scorer = TeacherScorer(config=_config(), teachers={"t": ScoringPool("t", [clients["other"]])})
    sample = await scorer(await _sample(clients["student"], "rev 4821", 7))
    assert sample.teacher_logprobs is not None
    ids = sample.prompt_ids + sample.response_ids
    lp, lq = _hf_logp(ckpts["student"], ids), _hf_logp(ckpts["other"], ids)
    start = len(sample.prompt_ids)
    signs = 0
    for j, tok in enumerate(sample.response_ids):
        d = sample.rollout_logprobs[j] - sample.teacher_logprobs[j]
        independent = (lp[start - 1 + j, tok] - lq[start - 1 + j, tok]).item()
        assert d == pytest.approx(independent, abs=1e-4)
        signs += (d > 0) == (independent > 0)
    assert signs == len(sample.response_ids) and any(
        sample.rollout_logprobs[j] != sample.teacher_logprobs[j] for j in range(len(ids) - start)
    )


async def test_samples_reach_the_teacher_of_their_label_and_an_unrouted_label_stops(
    clients: dict[str, EngineClient],
) -> None:
    config = _config(teachers=("math", "code"), routes={"m": "math", "c": "code"}, default_teacher=None)
    scorer = TeacherScorer(
        config=config,
        teachers={
            "math": ScoringPool("math", [clients["same"]]),
            "code": ScoringPool("code", [clients["other"]]),
        },
    )
    routed = [await scorer(await _sample(clients["student"], "rev 12", s, label)) for s, label in
              enumerate(["m", "c", "m"])]  # fmt: skip
    assert [s.teacher for s in routed] == ["math", "code", "math"]
    assert [s.label for s in routed] == ["m", "c", "m"]
    m = scorer.drain_metrics()
    assert (m["opd_math_samples"], m["opd_code_samples"], m["opd_samples_scored"]) == (2.0, 1.0, 3.0)
    assert m["opd_teacher_tokens"] == float(sum(len(s.response_ids) for s in routed))
    assert m["opd_math_latency_s_mean"] > 0 and m["opd_teacher_reply_bytes"] > 0
    with pytest.raises(
        UnroutedLabel, match=r"label 'x'.*add 'x' to a teacher's labels or set defaultTeacher"
    ):
        await scorer(await _sample(clients["student"], "rev 12", 9, "x"))


async def test_task_reward_zero_keeps_the_task_reward_for_the_report(
    clients: dict[str, EngineClient],
) -> None:
    scorer = TeacherScorer(
        config=_config(zero_task_reward=True), teachers={"t": ScoringPool("t", [clients["same"]])}
    )
    sample = await scorer(await _sample(clients["student"], "rev 12", 1))
    assert sample.reward == 0.0 and sample.metadata["task_reward"] == 1.0
    assert scorer.drain_metrics()["task_reward_mean"] == 1.0


@pytest.mark.parametrize(
    ("kind", "weight", "k"),
    [("teacher-top-k", "student", VOCAB), ("student-top-k", "teacher", 5), ("union", "uniform", 4),
     ("intersection", "student", 6), ("symmetric-difference", "teacher", 3)],
)  # fmt: skip
async def test_served_candidate_sets_match_the_closed_form(
    clients: dict[str, EngineClient], ckpts: dict[str, Path], kind: str, weight: str, k: int
) -> None:
    scorer = TeacherScorer(
        config=_config(candidate_set=kind, weight=weight, top_k=k),
        teachers={"t": ScoringPool("t", [clients["other"]])},
        student=ScoringPool("student", [clients["student"]]),
    )
    sample = await scorer(await _sample(clients["student"], "rev 4821", 3))
    assert sample.opd_logratio is not None
    ids = sample.prompt_ids + sample.response_ids
    lp, lq = _hf_logp(ckpts["student"], ids), _hf_logp(ckpts["other"], ids)
    start = len(sample.prompt_ids)
    for j in range(len(sample.response_ids)):
        p, q = lp[start - 1 + j], lq[start - 1 + j]
        s_top, t_top = set(p.topk(k).indices.tolist()), set(q.topk(k).indices.tolist())
        cands = {"teacher-top-k": t_top, "student-top-k": s_top, "union": s_top | t_top,
                 "intersection": s_top & t_top, "symmetric-difference": s_top ^ t_top}[kind]  # fmt: skip
        if not cands:
            assert sample.opd_logratio[j] == 0.0
            continue
        side = {"student": p, "teacher": q}.get(weight)
        w = {v: (math.exp(side[v].item()) if side is not None else 1.0) for v in cands}
        z = sum(w.values())
        expected = sum(w[v] / z * (p[v] - q[v]).item() for v in cands)
        assert sample.opd_logratio[j] == pytest.approx(expected, abs=1e-4)
    if k == VOCAB:  # the whole vocabulary with the student's weights: the exact reverse KL, >= 0
        assert all(d >= -1e-6 for d in sample.opd_logratio)
    m = scorer.drain_metrics()
    assert m["opd_candidate_set_size_mean"] > 0 and m["opd_student_computed_tokens"] >= 0


async def test_the_tokenizer_check_passes_on_equal_tokenizers_and_names_the_first_differing_id(
    clients: dict[str, EngineClient],
) -> None:
    student = clients["student"].detokenize
    assert await check_same_tokenizer("same", clients["other"].detokenize, student, VOCAB, chunk=40) == VOCAB
    with pytest.raises(
        TokenizerMismatch, match=r"teachers\[swapped\]: token ID 9 is '4' for the teacher and '3'"
    ):
        await check_same_tokenizer("swapped", clients["swapped"].detokenize, student, VOCAB, chunk=40)
