"""What a checkpoint's config says about MoE routing, read from config.json without torch.

Why it exists: R3 (routing replay, §4.1) only applies to mixture-of-experts models, and its
payload's shape [tokens - 1, layers, top-k] comes from the model config. The driver must refuse
`spec.algorithm.r3` on a dense model at start (before any engine runs), and cost estimates need the
shape; both only need config.json.

Who calls it: lockstep.driver (start-up checks), tests.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class RoutingShape:
    """The routing dimensions of a MoE checkpoint (HF config field names in brackets)."""

    num_layers: int
    """L: decoder layers (num_hidden_layers); the payload has one entry per layer, MoE or not."""
    top_k: int
    """k: experts per token (num_experts_per_tok)."""
    num_experts: int
    """E: routed experts per MoE layer (num_experts, or n_routed_experts / num_local_experts)."""

    def payload_bytes(self, num_tokens: int) -> int:
        """Raw R3 payload of one trajectory: (tokens - 1) x layers x top-k x 4 bytes."""
        return max(num_tokens - 1, 0) * self.num_layers * self.top_k * 4


def routing_shape(model_dir: str | os.PathLike[str]) -> RoutingShape | None:
    """The checkpoint's RoutingShape from its config.json, or None for a dense model."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)  # multimodal wrappers nest the language model's config
    experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0
    top_k = cfg.get("num_experts_per_tok") or 0
    if not experts or not top_k:
        return None
    return RoutingShape(num_layers=int(cfg["num_hidden_layers"]), top_k=int(top_k), num_experts=int(experts))
