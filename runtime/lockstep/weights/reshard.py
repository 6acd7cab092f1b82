"""Which part of a full HF tensor one tensor-parallel rank of an SGLang engine holds (§7.2.3).

Why it exists: P2P writes each engine rank only the bytes that rank keeps, in SGLang's layout, so the
sender must cut every full (gathered, HF-named) tensor the way SGLang's weight loaders would.
SGLang's loaders (the pinned wheel's srt/layers/linear.py, vocab_parallel_embedding.py and FusedMoE,
driven by each model's load_weights) are the definition; runtime/tests/sglang/test_p2p_layouts.py runs
them on every family we build and checks these rules against them, rank by rank:

- column-parallel (q/k/v, MLA's q_b/kv_b, gate/up of MLPs, shared and routed experts): rows split in
  `tp` equal blocks (dim 0);
- row-parallel (o_proj, down_proj): columns split (dim 1);
- K and V when the engine has fewer KV heads than TP ranks: each head is replicated on
  `tp / kv_heads` consecutive ranks (rank r holds head r // replicas);
- the vocabulary (embed_tokens, lm_head): padded to a multiple of 64 rows, then split; a rank's block
  past the real vocabulary is zeros;
- routed experts: split over the MoE TP group (its rank and size, tp / ep), and with expert parallel a
  rank holds only its experts (the target's slots say which);
- everything else (norms, routers, MLA's q_a/kv_a, the DSA indexer) is replicated.

The local shape of a target's slot (what the engine reports it holds) decides the cut where it is
known: the number of blocks is full / local, and rank r takes block r // (ranks / blocks).

Who calls it: lockstep.weights.p2p (sender and receiver).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

VOCAB_PADDING = 64
"""SGLang pads the vocabulary of embed_tokens and lm_head to a multiple of this (DEFAULT_VOCAB_PADDING_SIZE)."""

_COLUMN_RE = re.compile(
    r"(q_proj|k_proj|v_proj|q_b_proj|kv_b_proj|gate_proj|up_proj|embed_tokens|lm_head)\.(weight|bias)$"
)
_ROW_RE = re.compile(r"(o_proj|down_proj)\.weight$")
_VOCAB_RE = re.compile(r"(embed_tokens|lm_head)\.weight$")
_KV_RE = re.compile(r"self_attn\.[kv]_proj\.(weight|bias)$")
_EXPERT_RE = re.compile(r"\.experts\.\d+\.")


def shard_dim(name: str) -> int | None:
    """The TP split dimension of a tensor in SGLang's layout: 0 column-parallel, 1 row-parallel, None replicated."""
    if _COLUMN_RE.search(name):
        return 0
    if _ROW_RE.search(name):
        return 1
    return None


def is_vocab(name: str) -> bool:
    """embed_tokens / lm_head weights: split after padding the vocabulary to VOCAB_PADDING."""
    return _VOCAB_RE.search(name) is not None


def is_routed_expert(name: str) -> bool:
    """A routed expert's weight (`...mlp.experts.<e>.<proj>.weight`): split over the MoE TP group."""
    return _EXPERT_RE.search(name) is not None


def padded_vocab(rows: int) -> int:
    """The vocabulary SGLang allocates: `rows` rounded up to a multiple of VOCAB_PADDING."""
    return -(-rows // VOCAB_PADDING) * VOCAB_PADDING


def local_shape(name: str, shape: Iterable[int], tp_size: int, *, head_dim: int | None = None) -> list[int]:
    """The shape of `name` on one rank of `tp_size` (its group's size for experts); raises naming the
    tensor when SGLang could not split it. `head_dim` lets K/V replicate heads over more ranks than heads."""
    out = list(shape)
    dim = shard_dim(name)
    if tp_size == 1 or dim is None or dim >= len(out):
        return out
    if is_vocab(name) and dim == 0:
        total = padded_vocab(out[0])
        if total % tp_size:
            raise ValueError(f"{name}: the padded vocabulary {total} does not split over tp_size={tp_size}")
        out[0] = total // tp_size
        return out
    if head_dim and _KV_RE.search(name) and out[0] // tp_size < head_dim and out[0] % head_dim == 0:
        heads = out[0] // head_dim
        if tp_size % heads:
            raise ValueError(f"{name}: {heads} KV heads do not replicate evenly over tp_size={tp_size}")
        out[0] = head_dim  # one head per rank, replicated on tp_size / heads ranks
        return out
    if out[dim] % tp_size:
        raise ValueError(
            f"{name}: dim {dim} of size {out[dim]} does not split over tp_size={tp_size}; pick a TP size that divides it"
        )
    out[dim] //= tp_size
    return out


def shard(
    name: str, tensor: torch.Tensor, rank: int, size: int, local: Sequence[int] | None = None
) -> torch.Tensor:
    """The part of full `tensor` that rank `rank` of `size` holds, as a contiguous tensor of the local
    shape (`local`: the target's slot shape; default `local_shape`)."""
    import torch

    dim = shard_dim(name)
    if size == 1 or dim is None or dim >= tensor.dim():
        return tensor.contiguous()
    full = tensor.shape[dim]
    want = int(local[dim]) if local is not None else local_shape(name, tensor.shape, size)[dim]
    if is_vocab(name) and dim == 0:  # padded blocks: rows past the vocabulary are zeros
        start = rank * want
        part = tensor.narrow(0, min(start, full), max(0, min(want, full - start)))
        if part.shape[0] == want:
            return part.contiguous()
        pad = torch.zeros((want - part.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        return torch.cat([part, pad])
    if want < 1 or full % want:
        raise ValueError(f"{name}: a local size of {want} along dim {dim} does not divide {full}")
    blocks = full // want
    if size % blocks:
        raise ValueError(f"{name}: {blocks} blocks along dim {dim} do not spread evenly over {size} ranks")
    index = rank // (size // blocks)  # blocks < size: each block replicated on consecutive ranks
    return tensor.narrow(dim, index * want, want).contiguous()
