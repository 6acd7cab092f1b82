"""R3 in megatron-core: the rollout's experts forced through megatron-core's own router replay.

Why it exists: §4.1 (see lockstep.train.common.r3 for the payload and the FSDP side). megatron-core
0.16 ships routing replay in its TopKRouter (`moe_enable_routing_replay`: each router owns a
`RouterReplay` that, told REPLAY_FORWARD, takes its top-k indices from a target tensor and gathers its
own scores at them). We feed it: a forward pre-hook on every router of the model computes the router's
own top-k of this micro-batch (to measure r3_routing_mismatch and to fill the positions the payload
does not cover: padding, the last token, rows without data), overlays the rollout's experts where the
plan covers them and hands the result to the router's RouterReplay as its target. The router then
computes its gate values itself, at those experts, exactly as when it picks them: softmax over the
chosen logits (norm_topk_prob) or softmax over all experts gathered at them. A forward hook reads back
the routing map the router produced (for the capture tests use) and clears the replay state, so
nothing accumulates across micro-batches.

Token order: the router sees [S, B, H] (sequence first), flattened s-major (token s*B + b); the plan is
batch-first [B, T-1, L, k], column t holding token t's experts. Layers are global (the router's
layer_number), so a pipeline stage replays its own layers.

Who calls it: lockstep.train.megatron.backend (one `RouterReplayHooks` per model, `plan` set per
micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lockstep.train.common.r3 import R3PayloadError, ReplayPlan, RoutingRecord

if TYPE_CHECKING:
    import torch


def routers(model: Any) -> list[Any]:
    """Every TopKRouter of a (wrapped or bare) megatron-core model, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


@dataclass(slots=True)
class RouterReplayHooks:
    """Hooks on a model's routers; set `plan` before each forward (None: route freely)."""

    replay: bool = True
    """False: only measure the mismatch (the routers keep their own choices)."""
    capture: bool = False
    """Record the experts each router actually used (layer -> [B, T, k] CPU tensor), for tests."""
    plan: ReplayPlan | None = None
    """The micro-batch's rollout routing, aligned with its [B, T-1] layout."""
    record: RoutingRecord = field(default_factory=RoutingRecord)
    """Counts (and captures) since the last reset."""
    handles: list[Any] = field(default_factory=list)

    def install(self, model: Any) -> None:
        for router in routers(model):
            if router.router_replay is None:
                raise RuntimeError("R3: the Megatron model was built without moe_enable_routing_replay")
            self.handles.append(router.register_forward_pre_hook(self._before))
            self.handles.append(router.register_forward_hook(self._after))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _before(self, router: Any, args: tuple[Any, ...]) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self.plan is None:
            router.router_replay.clear_router_replay_action()
            return
        hidden = args[0]  # [S, B, H]
        s, b = hidden.shape[0], hidden.shape[1]
        own = _own_topk(router, hidden)  # [S, B, k]
        layer = int(router.layer_number) - 1
        target = self._overlay(own, layer, s, b)  # [S*B, k]
        if self.replay:
            router.router_replay.set_target_indices(target)
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        else:
            router.router_replay.clear_router_replay_action()

    def _overlay(self, own: torch.Tensor, layer: int, s: int, b: int) -> torch.Tensor:
        """Count mismatches on covered columns; return the target indices [S*B, k] (s-major)."""
        plan = self.plan
        assert plan is not None
        pb, t1 = plan.valid.shape
        if (pb, t1 + 1) != (b, s):
            raise R3PayloadError(
                f"R3 replay: router saw [S={s}, B={b}] tokens; the plan covers [B={pb}, T={t1 + 1}]"
            )
        own_bt = own.transpose(0, 1)  # [B, S, k]
        valid = plan.valid.to(own.device)  # [B, T-1]
        rollout = plan.indices[:, :, layer].to(own.device)  # [B, T-1, k]
        own_cov, roll_cov = own_bt[:, :-1][valid], rollout[valid]  # [n, k]
        differs = (own_cov.sort(-1).values != roll_cov.sort(-1).values).any(-1)
        self.record.pairs += int(valid.sum().item())
        self.record.mismatched += int(differs.sum().item())
        target = own_bt.clone()
        if self.replay:
            target[:, :-1][valid] = roll_cov
        return target.transpose(0, 1).reshape(s * b, -1)

    def _after(self, router: Any, args: tuple[Any, ...], output: Any) -> None:
        if self.capture and isinstance(output, tuple) and len(output) == 2:
            hidden = args[0]
            s, b = hidden.shape[0], hidden.shape[1]
            routing_map = output[1]  # [S*B, E] bool: the experts each token was sent to
            k = int(routing_map.sum(-1).max().item())
            used = routing_map.float().topk(k, dim=-1).indices.sort(-1).values  # [S*B, k]
            self.record.used[int(router.layer_number) - 1] = used.view(s, b, k).transpose(0, 1).cpu()
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()


def _own_topk(router: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The router's own top-k expert IDs [S, B, k] for `hidden`, as its routing function picks them."""
    import torch

    with torch.no_grad():
        logits = router.gating(hidden)  # [S, B, E]
        if router.config.moe_router_pre_softmax:
            logits = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        return torch.topk(logits, k=router.topk, dim=-1).indices
