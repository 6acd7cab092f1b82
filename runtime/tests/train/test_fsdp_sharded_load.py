"""Sharded loading: two gloo ranks under torchrun each read only their rows of a real safetensors
checkpoint; the weights are bit-identical to the whole-model load, and each rank's peak host memory
stays under a bound (its half of the checkpoint plus the staging bucket, with a margin) that the
whole-model load exceeds. The streamed save keeps to the same bound and writes what the whole-model
save wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lockstep.models import st_bytes as sb

RANK = Path(__file__).with_name("fsdp_load_rank.py")
BUCKET_MIB = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3 checkpoint of ~220 MB (fp32), untied embeddings, in two safetensors shards."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=8000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=64, tie_word_embeddings=False)  # fmt: skip
    d = tmp_path_factory.mktemp("ckpt")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen3ForCausalLM(cfg).save_pretrained(d, max_shard_size="120MB")
    return d


def run_ranks(checkpoint: Path, mode: str, out: Path, ranks: int = 2, save: Path | None = None) -> list[dict]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(ranks), str(RANK), "--checkpoint",
           str(checkpoint), "--mode", mode, "--out", str(out), "--bucket-mib", str(BUCKET_MIB)]  # fmt: skip
    if save is not None:
        cmd += ["--save", str(save)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])


def test_each_rank_reads_its_rows_and_gets_the_same_bits(checkpoint: Path, tmp_path: Path) -> None:
    size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    sharded = run_ranks(checkpoint, "sharded", tmp_path / "sharded.jsonl", save=tmp_path / "saved-sharded")
    whole = run_ranks(checkpoint, "whole", tmp_path / "whole.jsonl")
    print(
        {
            m: [(r["peak_bytes"] >> 20, r.get("save_peak_bytes", 0) >> 20) for r in rs]
            for m, rs in (("sharded", sharded), ("whole", whole))
        },
        size >> 20,
    )
    # bit-identical weights: the gathered tensors of both loads, and the checkpoint's own bytes
    assert sharded[0]["digests"] == whole[0]["digests"]
    on_disk = {e.name: sb.checksum(data) for e, data in sb.iter_checkpoint_bytes(checkpoint)}
    assert {n: d for n, d in sharded[0]["digests"].items() if n in on_disk} == on_disk
    bound = size / 2 * 1.2 + (BUCKET_MIB << 20)  # the rank's half, its staging bucket, a 20% margin
    for r in sharded:
        assert r["peak_bytes"] < bound, (r["rank"], r["peak_bytes"], bound)
        assert r["save_peak_bytes"] < bound, (r["rank"], r["save_peak_bytes"], bound)
    for r in whole:  # the bound fails for the whole-model load: the test can tell them apart
        assert r["peak_bytes"] > bound, (r["rank"], r["peak_bytes"], bound)
    # the streamed save writes the checkpoint's tensors, bit for bit
    saved = {e.name: sb.checksum(data) for e, data in sb.iter_checkpoint_bytes(tmp_path / "saved-sharded")}
    assert saved == on_disk
