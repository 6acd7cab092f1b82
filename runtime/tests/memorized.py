"""A tiny checkpoint that has memorized a few chat transcripts, so that greedy decoding reproduces them.

Why it exists: the session-server and terminal-agent tests need a real model whose replies are known
(a real tool call, a turn that ends with <|eos|>), built offline in seconds from the built-in tiny
model; their fixtures differ only in the transcripts and the number of steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def memorized_tiny(transcripts: Sequence[str], base_dir: Path, out: Path, *, steps: int) -> Path:
    """Train builtin:tiny (seed 0) with Adam at 2e-2 for `steps` full-batch steps on `transcripts`
    (padding not learned), on one thread (the CI machine has 2 shared cores: as fast and fairer), and
    save it with its tokenizer to `out`."""
    import torch
    from lockstep.models.tiny import chat_tokenizer, materialize_builtin, save_tokenizer
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(materialize_builtin("builtin:tiny", base_dir, seed=0))
    enc = [chat_tokenizer().encode(t) for t in transcripts]
    width = max(map(len, enc))
    ids = torch.tensor([e + [0] * (width - len(e)) for e in enc])  # [N, T]
    labels = torch.tensor([e + [-100] * (width - len(e)) for e in enc])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        opt = torch.optim.Adam(model.parameters(), lr=2e-2)
        for _ in range(steps):
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out)
    save_tokenizer(out)
    return out
