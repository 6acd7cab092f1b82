"""`lockstep run` of an SFT job (spec.recipe sft) on the tiny model: no engine, the trainer alone.

- the loss falls over the steps, and the saved checkpoint is an HF checkpoint transformers loads alone
  (and whose greedy answer its tokenizer decodes);
- resume continues from the last checkpoint at the same data position;
- rows come from the same sources as RL: JSON lines of {"prompt", "response"} and multi-turn
  {"messages"} rows, trained on their assistant tokens only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lockstep.cli import main
from lockstep.observability.metrics import read_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.heavy  # whole runs and a torchrun group (`make check` leaves them out)

EXAMPLE = Path(__file__).parents[3] / "examples" / "tiny-sft.yaml"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _manifest(tmp_path: Path, edit: dict[str, Any]) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"]["checkpoint"] = "builtin:tiny"  # one layer: seconds per step here
    for dotted, value in edit.items():
        node = doc
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _latest(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()


def test_sft_lowers_the_loss_and_saves_an_hf_checkpoint(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    job = _manifest(tmp_path, {"spec.algorithm.batchSize": 16, "spec.algorithm.learningRate": 3.0e-3,
                               "spec.schedule.steps": 12, "spec.schedule.saveInterval": 6})  # fmt: skip
    assert main(["run", str(job), "--run-dir", str(run_dir), "--cache-dir", str(cache)]) == 0
    assert "done: step 12, loss " in capsys.readouterr().out
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["kind"] for r in rows] == ["train"] * 12  # no engine: no weight update, no rollout
    losses = [r["loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    assert all(r["sft_rows"] == 16 and r["sft_tokens_per_s"] > 0 and r["train_tokens"] > 0 for r in rows)
    ckpt = _latest(run_dir)
    model = AutoModelForCausalLM.from_pretrained(ckpt)  # transformers alone, no Lockstep code
    tok = AutoTokenizer.from_pretrained(ckpt)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "rev 123"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
    assert isinstance(tok.decode(out[0, len(prompt) :]), str)
    assert (run_dir / "metrics.png").stat().st_size > 0


def test_resume_continues_at_the_same_data_position(tmp_path: Path, cache: Path) -> None:
    run_dir = tmp_path / "run"
    job = _manifest(
        tmp_path, {"spec.algorithm.batchSize": 4, "spec.schedule.steps": 4, "spec.schedule.saveInterval": 2}
    )
    args = ["run", str(job), "--run-dir", str(run_dir), "--cache-dir", str(cache)]
    assert main([*args, "--steps", "2"]) == 0
    assert main([*args, "--resume"]) == 0
    state = json.loads((_latest(run_dir) / "trainer_state.json").read_text())
    assert state["extra"]["step"] == 4 and state["extra"]["prompts_consumed"] == 16
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]


def test_prompt_response_and_multi_turn_rows(tmp_path: Path, cache: Path) -> None:
    data = tmp_path / "sft.jsonl"
    rows = [
        {"prompt": "rev 123", "response": "321"},
        {"messages": [{"role": "user", "content": "rev 45"}, {"role": "assistant", "content": "54"},
                      {"role": "user", "content": "rev 67"}, {"role": "assistant", "content": "76"}]},
    ]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = _manifest(
        tmp_path, {"spec.data.prompts": str(data), "spec.algorithm.batchSize": 2, "spec.schedule.steps": 2}
    )
    run_dir = tmp_path / "run"
    assert main(["run", str(job), "--run-dir", str(run_dir), "--cache-dir", str(cache)]) == 0
    [first, _] = read_jsonl(run_dir / "metrics.jsonl")
    # Trained tokens: "321" + eos, then "54" + eos and "76" + eos (the tiny tokenizer: one token per digit).
    assert first["train_tokens"] == 4 + 3 + 3


def test_a_row_without_a_reply_is_refused_naming_it(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "rev 1"}) + "\n")
    job = _manifest(tmp_path, {"spec.data.prompts": str(data)})
    assert main(["run", str(job), "--run-dir", str(tmp_path / "run"), "--cache-dir", str(cache)]) == 2
    assert f"{data}:1" in capsys.readouterr().err


def test_a_trainer_group_runs_the_sft_steps_without_engines(tmp_path: Path, cache: Path) -> None:
    """`torchrun --nproc-per-node 2 -m lockstep trainer --serve` (gloo, loopback) with no engine anywhere,
    and `lockstep driver` sending it the rows: the steps, the checkpoint, both ranks exit 0."""
    import os
    import socket
    import subprocess
    import sys
    import time

    import httpx

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    job = _manifest(tmp_path, {"spec.algorithm.batchSize": 4, "spec.schedule.steps": 3,
                               "spec.trainer.gpusPerNode": 2})  # fmt: skip
    port, out, log = free_port(), tmp_path / "trainer", tmp_path / "group.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")} | {"OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "lockstep", "trainer", "--config", str(job), "--serve",
        "--host", "127.0.0.1", "--port", str(port), "--out", str(out), "--cache-dir", str(cache),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/health", timeout=2).json()["ready"]:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        args = ["driver", "--config", str(job), "--run-dir", str(tmp_path / "driver"),
                "--trainer-url", f"http://127.0.0.1:{port}"]  # fmt: skip
        assert main(args) == 0
        assert proc.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rows = read_jsonl(tmp_path / "driver" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["train_tokens"] > 0 for r in rows)
    state = json.loads((_latest(out) / "trainer_state.json").read_text())
    assert state["extra"]["step"] == 3
