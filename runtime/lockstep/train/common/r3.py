"""R3, rollout routing replay (§4.1): decode the rollout's expert IDs and replay them in the trainer.

Why it exists: a MoE router keeps the top-k of its scores, a discrete choice that a few bits of
floating-point difference can flip. If the trainer recomputes top-k it may send token t through
expert 8 where the rollout used expert 7: expert 8 gets a gradient for a token it never produced and
expert 7 gets none. R3 records the rollout's choices and makes the trainer use them.

Payload (SGLang's `meta_info.routed_experts`, already base64-decoded by the client into
`Sample.routed_experts`): the bytes of a C-order little-endian int32 array [n - 1, L, k], where n is the
sample's prompt + response length, L the model's num_hidden_layers and k its num_experts_per_tok.
Row i holds the experts that token i (the token at position i) went through in each layer; the last
token has no row since it was sampled but never run through the model. Layers without a MoE block
hold zeros. Size: (n - 1) * L * k * 4 bytes.

Alignment with TrainBatch: row i of sample b lands at column i of the shifted [B, T-1] layout, whose
column t holds what the logits at position t predict (token t+1); the routing of token t is exactly
what produced those logits. Padding columns and rows without a payload are not replayed.

Replay (`hf_routing`): a forward hook on each HF MoE router (transformers >= 5: `mlp.gate` returns
(router logits, gate values, expert IDs)) swaps in the replayed IDs. R3 fixes membership, not gate
values: the gate values are the trainer's own router probabilities (softmax in fp32 of its logits)
gathered at the replayed IDs and renormalised over them when the config's norm_topk_prob is true,
exactly as the router treats its own top-k. So replaying the trainer's own choices changes nothing.
Without replay the hook only measures.

Metrics: r3_routing_mismatch is the fraction of (token, MoE layer) pairs covered by a payload where
the trainer's own top-k set differs from the rollout's; it is measured with replay on or off (with
replay on, it says what the trainer would have chosen). r3_payload_bytes is the raw payload size.

Who calls it: lockstep.train.fsdp.backend (builds a ReplayPlan per micro-batch, runs the forward
inside `hf_routing`), lockstep.driver (collate_routed_experts when building the batch), tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lockstep.numerics.experts import GATES_AT_ATTR
from lockstep.types import Group

if TYPE_CHECKING:
    import torch

INT32_BYTES = 4
"""sizeof(int32): the element size of the payload."""


class R3PayloadError(ValueError):
    """A routing payload that cannot be aligned with its sample (wrong length, bad expert ID)."""


def payload_nbytes(num_tokens: int, num_layers: int, top_k: int) -> int:
    """Raw payload size of one sample of `num_tokens` tokens: (tokens - 1) x layers x top-k x 4."""
    return max(num_tokens - 1, 0) * num_layers * top_k * INT32_BYTES


def encode_routed_experts(ids: torch.Tensor) -> bytes:
    """[n-1, L, k] integer tensor -> payload bytes (int32, little-endian, C order)."""
    import torch

    arr = ids.detach().to("cpu", torch.int32).contiguous().numpy()
    return bytes(arr.astype("<i4", copy=False).tobytes())


def decode_routed_experts(
    payload: bytes,
    num_tokens: int,
    num_layers: int,
    top_k: int,
    *,
    num_experts: int | None = None,
    where: str = "sample",
) -> torch.Tensor:
    """Payload bytes -> int64 [num_tokens - 1, L, k]; raises R3PayloadError naming `where`.

    num_tokens: the sample's prompt + response length. num_experts: when given, every ID must be in
    [0, num_experts).
    """
    import numpy as np
    import torch

    rows = max(num_tokens - 1, 0)
    want = payload_nbytes(num_tokens, num_layers, top_k)
    if len(payload) != want:
        got = len(payload) / (num_layers * top_k * INT32_BYTES) if num_layers * top_k else float("nan")
        raise R3PayloadError(
            f"{where}: routed_experts has {len(payload)} bytes ({got:g} token rows); expected int32 "
            f"[{rows}, {num_layers}, {top_k}] = {want} bytes for {num_tokens} tokens (prompt + response - 1 "
            "rows). The engine's routing does not cover this sample's tokens: was the payload taken from "
            "another request, or the response edited after generation?"
        )
    arr = np.frombuffer(payload, dtype="<i4").reshape(rows, num_layers, top_k)
    out = torch.from_numpy(arr.astype(np.int64))  # [n-1, L, k]
    if num_experts is not None and out.numel() and (int(out.min()) < 0 or int(out.max()) >= num_experts):
        raise R3PayloadError(
            f"{where}: routed_experts holds expert IDs in [{int(out.min())}, {int(out.max())}]; this model "
            f"has {num_experts} experts (IDs 0..{num_experts - 1}): the payload is from another model"
        )
    return out


def collate_routed_experts(groups: Sequence[Group]) -> list[bytes | None]:
    """Sample.routed_experts of every sample, in pack_groups' row order (TrainBatch.routed_experts)."""
    return [sample.routed_experts for group in groups for sample in group.samples]


@dataclass(slots=True)
class ReplayPlan:
    """The rollout's routing of one (micro-)batch, aligned with its [B, T-1] shifted layout."""

    indices: torch.Tensor
    """[B, T-1, L, k] int64 expert IDs: column t holds token t's experts in every layer."""
    valid: torch.Tensor
    """[B, T-1] bool, True where a payload covers the column (real tokens 0..n-2 of rows with data)."""
    payload_bytes: int
    """Raw payload bytes of the rows (the R3 cost, §4.1)."""


def build_replay(
    routed_experts: Sequence[bytes | None],
    attention_mask: torch.Tensor,
    *,
    num_layers: int,
    top_k: int,
    num_experts: int,
    row_offset: int = 0,
) -> ReplayPlan | None:
    """Decode a batch's payloads into a ReplayPlan; None when no row carries one.

    attention_mask: [B, T] (1 on real tokens; rows are right-padded, so n_b = its row sum).
    routed_experts: one entry per row (None: that row is not replayed, e.g. an aborted sample).
    row_offset: index of the first row in the whole batch, for error messages of micro-batches.
    """
    import torch

    if not routed_experts or all(p is None for p in routed_experts):
        return None
    b, t = attention_mask.shape
    if len(routed_experts) != b:
        raise R3PayloadError(
            f"TrainBatch.routed_experts has {len(routed_experts)} entries for {b} rows; give one per sample "
            "(None where a sample has no routing data)"
        )
    if top_k <= 0:
        raise R3PayloadError(
            "TrainBatch.routed_experts carries R3 routing data but the model has no MoE layers; "
            "turn R3 off for dense models"
        )
    indices = torch.zeros((b, t - 1, num_layers, top_k), dtype=torch.long)
    valid = torch.zeros((b, t - 1), dtype=torch.bool)
    lengths = attention_mask.sum(-1).tolist()
    total = 0
    for i, payload in enumerate(routed_experts):
        if payload is None:
            continue
        n = int(lengths[i])
        rows = decode_routed_experts(
            payload, n, num_layers, top_k, num_experts=num_experts, where=f"sample row {row_offset + i}"
        )
        indices[i, : n - 1] = rows
        valid[i, : n - 1] = True
        total += len(payload)
    return ReplayPlan(indices=indices, valid=valid, payload_bytes=total)


@dataclass(slots=True)
class RoutingRecord:
    """What one forward under `hf_routing` saw."""

    pairs: int = 0
    """(token, MoE layer) pairs covered by the plan."""
    mismatched: int = 0
    """Of those, pairs where the trainer's own top-k set differed from the rollout's."""
    used: dict[int, torch.Tensor] = field(default_factory=dict)
    """With capture: layer index -> [B, T, k] expert IDs the forward actually used (CPU)."""

    @property
    def mismatch(self) -> float:
        """r3_routing_mismatch of this forward (0 when nothing was covered)."""
        return self.mismatched / self.pairs if self.pairs else 0.0


def moe_routers(model: Any) -> list[tuple[int, Any]]:
    """(layer index, router module) of every sparse MoE layer of an HF causal LM (transformers >= 5)."""
    out = []
    for li, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(layer.mlp, "experts"):
            if not hasattr(gate, "top_k"):
                raise NotImplementedError(
                    f"layer {li}: {type(layer.mlp).__name__} predates transformers 5's router module; "
                    "R3 replay needs transformers >= 5"
                )
            out.append((li, gate))
    return out


def routing_dims(config: Any) -> tuple[int, int, int]:
    """(num_layers L, top_k k, num_experts E) of an HF config; k = E = 0 for a dense model."""
    layers = int(config.num_hidden_layers)
    experts = int(getattr(config, "num_experts", 0) or 0)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0
    return layers, top_k, experts


@contextlib.contextmanager
def hf_routing(
    model: Any, plan: ReplayPlan | None, *, replay: bool = True, capture: bool = False
) -> Iterator[RoutingRecord]:
    """Within the block, every MoE router of `model` measures (and with `replay`, replays) `plan`.

    The forward must run on the plan's [B, T] batch (the router sees B*T rows in batch-major order).
    With plan None nothing is hooked unless `capture` asks to record the experts used.
    """
    record = RoutingRecord()
    if plan is None and not capture:
        yield record
        return
    handles = [
        router.register_forward_hook(_make_hook(li, plan, record, replay=replay, capture=capture))
        for li, router in moe_routers(model)
    ]
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


def _make_hook(
    li: int, plan: ReplayPlan | None, record: RoutingRecord, *, replay: bool, capture: bool
) -> Any:
    def hook(module: Any, args: Any, output: Any) -> Any:
        if not (isinstance(output, tuple) and len(output) == 3):
            raise NotImplementedError(
                f"R3 replay: layer {li}'s router {type(module).__name__} does not return (logits, gate "
                "values, expert IDs) like transformers' Qwen3-MoE router; this model is not supported yet"
            )
        logits, _weights, own = output  # [N, E], [N, k], [N, k]: HF router semantics
        if plan is None:
            if capture:
                record.used[li] = own.detach().to("cpu")
            return None
        b, t1 = plan.valid.shape
        t = t1 + 1
        if own.shape[0] != b * t:
            raise R3PayloadError(
                f"R3 replay: layer {li}'s router saw {own.shape[0]} tokens; the plan covers [{b}, {t}]"
            )
        own_btk = own.view(b, t, -1)  # [B, T, k]
        valid = plan.valid.to(own.device)  # [B, T-1]
        rollout = plan.indices[:, :, li].to(own.device)  # [B, T-1, k]
        own_cov = own_btk[:, :-1][valid]  # [n, k]
        roll_cov = rollout[valid]  # [n, k]
        differs = (own_cov.sort(-1).values != roll_cov.sort(-1).values).any(-1)  # [n]: sets differ
        record.pairs += int(valid.sum().item())
        record.mismatched += int(differs.sum().item())
        if not replay:
            if capture:
                record.used[li] = own_btk.detach().to("cpu")
            return None
        idx_btk = own_btk.clone()
        idx_btk[:, :-1][valid] = roll_cov  # replayed where covered, the trainer's own top-k elsewhere
        idx = idx_btk.view(b * t, -1)  # [N, k]
        import torch

        gates_at = getattr(module, GATES_AT_ATTR, None)  # a router with its own kernels (true on-policy)
        if gates_at is not None:
            gates = gates_at(logits, idx)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [N, E], as the router computes them
            gates = probs.gather(1, idx)  # [N, k]: the trainer's own scores at the rollout's experts
            if getattr(module, "norm_topk_prob", False):
                gates = gates / gates.sum(dim=-1, keepdim=True)
        if capture:
            record.used[li] = idx_btk.detach().to("cpu")
        return logits, gates.to(logits.dtype), idx

    return hook
