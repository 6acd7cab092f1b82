"""The reference engine's runner for architectures the slotted KV-cache runner does not build.

Why it exists: lockstep.engine.runner runs its own forward over Qwen3-style attention (q/k norm,
GQA, full rotary) with a slotted KV cache. Other families a job may name (GLM-5's MLA attention with
the DSA indexer and shared experts, and whatever transformers adds next) still need a reference
engine on CPU and in tests, with the same scheduler, weights API and logprob definition. This runner
keeps each slot's token IDs instead of its K/V and runs the transformers model's own forward over
the whole visible prefix of a row at every step: exact by construction (the trainer runs the same
module code), quadratic in the sequence length, so it is for small models. SGLang is the production
engine for these families.

Same interface as ModelRunner (prefill, decode, copy_prefix, logits, read_routes, generator), so the
scheduler (lockstep.engine.scheduler) is unchanged. R3 routing capture is not available here: `routes`
is None, and an R3 request is refused by the scheduler as for a dense model.

Who calls it: lockstep.engine.core (chosen by `slotted_runner_supports`), then the scheduler.
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.numerics import exact

SLOTTED_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})
"""config.model_type values lockstep.engine.runner's own forward is written for."""


def slotted_runner_supports(config: Any) -> bool:
    """True when lockstep.engine.runner.ModelRunner can run this model config."""
    return str(getattr(config, "model_type", "")) in SLOTTED_MODEL_TYPES


class RecomputeRunner:
    """Token-slot runner: every forward recomputes the row's visible prefix with the HF model."""

    def __init__(
        self,
        model: Any,
        *,
        max_slots: int,
        context_length: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
        cuda_graphs: bool = False,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        del dtype, cuda_graphs  # the model's own dtype; nothing to capture
        if kv_cache_dtype is not None:  # there is no KV cache to quantize: refuse rather than ignore
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype}: the reference engine keeps no KV cache for "
                f"{getattr(model.config, 'model_type', '?')} models (recompute runner); leave it unset"
            )
        self.model = model
        """The transformers causal LM holding the live weights (eval mode, on `device`)."""
        self.device = device
        self.max_slots = max_slots
        """S: sequences that can run at once."""
        self.context_length = context_length
        """M: the longest sequence (prompt + output) in tokens."""
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        self.routes: torch.Tensor | None = None
        """No routing capture on this runner (R3 needs the slotted runner's MoE path)."""
        self.cuda_graphs = False
        if exact.tiles_of(model) is not None:
            raise ValueError(
                f"true on-policy: the batch-invariant kernels are built for the slotted runner's attention, "
                f"not for {getattr(model.config, 'model_type', '?')} models; turn trueOnPolicy off"
            )
        self.tiles: Any = None
        """True on-policy tiles: never on this runner (sampling uses the default logprob path)."""
        self.tokens = torch.zeros((max_slots, context_length + 1), dtype=torch.long)
        """[S, M+1] token IDs per (slot, position); position M is the trash column of padded rows."""
        self.generator = torch.Generator(device=device)
        """The engine's generator for rows without a sampling_seed."""
        self.generator.manual_seed(seed)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden [..., H] -> fp32 logits [..., V]."""
        out: torch.Tensor = self.model.lm_head(hidden).float()
        return out

    def _hidden(self, slot: int, length: int) -> torch.Tensor:
        """Normed final hidden states [length, H] of the slot's tokens 0..length-1."""
        ids = self.tokens[slot, :length].to(self.device)[None]  # [1, T]
        out = self.model.model(input_ids=ids, use_cache=False)
        hidden: torch.Tensor = out.last_hidden_state[0]
        return hidden

    @torch.inference_mode()
    def prefill(
        self,
        rows: list[list[int]],
        starts: list[int],
        slots: list[int],
        full_logits_rows: set[int] | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Store rows[i] at positions starts[i].. of slots[i]; return last-token logits [B, V] (and,
        for i in full_logits_rows, the logits of every position of row i, [T_i, V])."""
        last, full = [], {}
        for i, (row, s0, slot) in enumerate(zip(rows, starts, slots, strict=True)):
            end = s0 + len(row)
            self.tokens[slot, s0:end] = torch.tensor(row, dtype=torch.long)
            hidden = self._hidden(slot, end)  # [end, H]
            last.append(self.logits(hidden[end - 1]))
            if full_logits_rows and i in full_logits_rows:
                full[i] = self.logits(hidden[s0:end])  # [T_i, V]
        return torch.stack(last), full

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], num_slots: int) -> torch.Tensor:
        """One step over slots [0, num_slots): tokens[s] at positions[s] -> logits [num_slots, V].

        Idle slots pass position == context_length and get zero logits (never sampled from)."""
        out = torch.zeros((num_slots, self.vocab_size), dtype=torch.float32, device=self.device)
        for slot in range(num_slots):
            pos = positions[slot]
            if pos >= self.context_length:
                continue
            self.tokens[slot, pos] = tokens[slot]
            out[slot] = self.logits(self._hidden(slot, pos + 1)[pos])
        return out

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy the tokens of positions [0, length) of slot src into slot dst (prefix-cache reuse)."""
        self.tokens[dst, :length].copy_(self.tokens[src, :length])

    def read_routes(self, slot: int, num_tokens: int) -> bytes:
        raise ValueError("read_routes: this engine runs the model without routing capture (no R3)")
