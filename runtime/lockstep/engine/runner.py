"""The model runner of the reference engine: a Qwen3 forward pass over a slotted KV cache, and sampling.

Why it exists: the reference engine must generate many sequences together with a KV cache, the way
SGLang does, while holding the weights in transformers' Qwen3ForCausalLM modules under HF names (so
weight updates and the trainer use the same names). HF's generate() is not used: this module runs
its own forward over those modules.

KV cache layout: k and v are [L, S, Hkv, M + 1, D] (layers, slots, kv heads, positions, head dim).
Each running sequence owns one slot; position M is a trash column: padded prefill tokens and idle
decode rows write there, and attention never reads it (it reads positions < kv_len <= M). Attention
uses a position mask (key j visible to a query at position p iff j <= p), so no per-slot lengths are
needed inside the step; stale entries beyond a sequence's length are never visible because position
p is written in the same step before it is read.

Decode steps on CUDA can be captured into CUDA graphs, one per (batch bucket, kv-length bucket),
since every step then has static shapes (the input buffers are copied into before replay).

MoE models (Qwen3-MoE, e.g. builtin:tiny-moe): a layer whose MLP is a sparse MoE block runs the HF
block's own router (`mlp.gate`: softmax in fp32, top-k, renormalised when the config's
norm_topk_prob says so) and its own experts (`mlp.experts`), called separately so that the chosen
expert IDs can be recorded. They go to a routing cache laid out like the KV cache, [S, M + 1, L, k]
int32 (slots, positions, layers, top-k), written at (slot, position) in the same step as the K/V, so
prefix-cache reuse carries the prompt's routing exactly as it carries its KV (SGLang indexes its
routed-experts buffer by KV location for the same reason). `read_routes` returns a finished
sequence's rows 0..n-2 for R3 (§4.1). Layers without a MoE block keep zeros, as in SGLang.
CUDA graphs are switched off for MoE models: HF's expert dispatch selects experts with
data-dependent shapes, which a graph cannot capture.

Logprob definition (matches SGLang's default, SGLANG_RETURN_ORIGINAL_LOGPROB unset): for temperature
T >= 1e-6 the returned logprob of the sampled token is log_softmax(logits / T)[token], taken before
top-k / top-p truncation; for greedy (T < 1e-6, SGLang's rule) it is log_softmax(logits)[token]. logits
are computed in fp32 from the final hidden state. The trainer must compute the same (logits / T, then log_softmax).
Prompt logprobs (logprob_start_len >= 0) are log_softmax of the raw logits, as SGLang's
input_token_logprobs are unless its temperature-scaled logprobs are switched on.

Who calls it: lockstep.engine.scheduler (each step) and lockstep.engine.core (which builds it) only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lockstep.numerics import exact, kernels
from lockstep.serving.sampling_limits import GREEDY_BELOW

# Buckets of captured CUDA graphs: batch sizes and kv lengths are rounded up to these.
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def _bucket(n: int, buckets: tuple[int, ...], cap: int) -> int:
    for b in buckets:
        if b >= n:
            return min(b, cap)
    return cap


def _kv_bucket(n: int, cap: int) -> int:
    b = 64
    while b < n:
        b *= 2
    return min(b, cap)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors on the device."""

    temperature: torch.Tensor
    """[B] fp32; below GREEDY_BELOW (0 included) means greedy."""
    top_p: torch.Tensor
    """[B] fp32 in (0, 1]."""
    top_k: torch.Tensor
    """[B] int64; values <= 0 keep the whole vocabulary."""
    generators: list[torch.Generator | None]
    """Per row, a seeded generator (sampling_seed) or None for the engine's generator."""


class ModelRunner:
    """Owns the model, the KV cache and the captured graphs; every method runs on one thread."""

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
        cfg = model.config
        self.model = model
        """The HF Qwen3ForCausalLM holding the live weights (eval mode, on `device`)."""
        self.device = device
        self.dtype = dtype
        self.max_slots = max_slots
        """S: sequences that can run at once."""
        self.context_length = context_length
        """M: the longest sequence (prompt + output) in tokens."""
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.vocab_size = int(cfg.vocab_size)
        self.moe_layers: tuple[bool, ...] = tuple(_is_moe_block(layer.mlp) for layer in model.model.layers)
        """Per layer, whether its MLP is a sparse MoE block (routing is recorded for those)."""
        self.top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0) if any(self.moe_layers) else 0
        """k of the MoE router (0 for a dense model)."""
        self.routes: torch.Tensor | None = None
        """[S, M+1, L, k] int32 expert IDs per (slot, position, layer); None for a dense model."""
        if self.top_k:
            self.routes = torch.zeros(
                (max_slots, context_length + 1, self.num_layers, self.top_k), dtype=torch.int32, device=device
            )
        shape = (self.num_layers, max_slots, self.num_kv_heads, context_length + 1, self.head_dim)
        cache_dtype = kv_cache_dtype or dtype
        # An FP8 cache (SGLang's --kv-cache-dtype fp8_e4m3|fp8_e5m2, scale 1.0): K/V are rounded to
        # FP8 when written and read back in the model dtype.
        self.k_cache = torch.zeros(shape, dtype=cache_dtype, device=device)  # [L, S, Hkv, M+1, D]
        self.v_cache = torch.zeros(shape, dtype=cache_dtype, device=device)  # [L, S, Hkv, M+1, D]
        self.generator = torch.Generator(device=device)
        """The engine's generator for rows without a sampling_seed."""
        self.generator.manual_seed(seed)
        self.cuda_graphs = cuda_graphs and not (self.top_k and device.type == "cuda")
        """Decode on static bucketed buffers, captured into CUDA graphs on CUDA (eager on CPU, for tests).
        Off on CUDA for MoE models (see the module doc)."""
        self.tiles = exact.tiles_of(model)
        """True on-policy: the batch-invariant kernels' tiles (lockstep.numerics.exact), else None."""
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, dict[str, torch.Tensor]]] = {}
        self._graph_pool: Any = None

    # -- forward ---------------------------------------------------------------------------------

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv_len: int,
        contiguous: bool,
    ) -> torch.Tensor:
        """Run the layers; write K/V of every token at (slot, position); return normed hidden [B, T, H].

        input_ids, positions: [B, T] int64; slots: [B] int64. contiguous: slots == arange(B), so the
        cache is sliced instead of gathered.
        """
        inner = self.model.model
        b, t = input_ids.shape
        h = inner.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = inner.rotary_emb(h, positions)  # [B, T, D] each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]
        # Key j is visible to the query at position p iff j <= p.
        mask = torch.arange(kv_len, device=h.device)[None, None, None, :] <= positions[:, None, :, None]
        slot_bt = slots[:, None].expand(b, t)  # [B, T]
        for li, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_norm(attn.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(
                1, 2
            )  # [B, Hq, T, D]
            k = attn.k_norm(attn.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
            v = attn.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin  # [B, Hkv, T, D]
            kc, vc = self.k_cache[li], self.v_cache[li]  # [S, Hkv, M+1, D]
            kc[slot_bt, :, positions] = k.transpose(1, 2).to(kc.dtype)  # indexed view is [B, T, Hkv, D]
            vc[slot_bt, :, positions] = v.to(vc.dtype)
            if contiguous:
                keys, values = kc[:b, :, :kv_len], vc[:b, :, :kv_len]  # [B, Hkv, kv_len, D]
            else:
                keys, values = kc[slots, :, :kv_len], vc[slots, :, :kv_len]
            keys, values = keys.to(h.dtype), values.to(h.dtype)
            if self.tiles is not None:  # true on-policy: the trainer's attention, bit for bit
                o = kernels.attention(q, keys, values, mask, attn.scaling, self.tiles)
            else:
                o = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, enable_gqa=True
                )  # [B, Hq, T, D]
            h = h + attn.o_proj(o.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))
            if self.routes is not None and self.moe_layers[li]:
                h = h + self._moe(layer.mlp, layer.post_attention_layernorm(h), li, slot_bt, positions)
            else:
                h = h + layer.mlp(layer.post_attention_layernorm(h))
        out: torch.Tensor = inner.norm(h)
        return out

    def _moe(
        self, mlp: Any, x: torch.Tensor, li: int, slot_bt: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The sparse MoE block on x [B, T, H], recording its top-k expert IDs at (slot, position, li)."""
        b, t, hidden = x.shape
        flat = x.reshape(b * t, hidden)  # [N, H], rows in (batch, position) order as HF's block does
        _, weights, idx = mlp.gate(flat)  # [N, k] gate values and expert IDs, HF router semantics
        assert self.routes is not None
        self.routes[slot_bt, positions, li] = idx.view(b, t, -1).to(torch.int32)  # [B, T, k]
        out: torch.Tensor = mlp.experts(flat, idx, weights)  # [N, H]
        return out.view(b, t, hidden)

    def read_routes(self, slot: int, num_tokens: int) -> bytes:
        """R3 payload of a slot: int32 [num_tokens, L, k] of positions 0..num_tokens-1, C order,
        little-endian (SGLang's meta_info.routed_experts before base64)."""
        if self.routes is None:
            raise ValueError("read_routes: this is a dense model, there are no routed experts")
        rows = self.routes[slot, :num_tokens].to("cpu").contiguous()  # [n, L, k]
        return bytes(rows.numpy().astype("<i4", copy=False).tobytes())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden [..., H] -> fp32 logits [..., V]."""
        out: torch.Tensor = self.model.lm_head(hidden).float()
        return out

    @torch.inference_mode()
    def prefill(
        self,
        rows: list[list[int]],
        starts: list[int],
        slots: list[int],
        full_logits_rows: set[int] | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Compute KV of rows[i] at positions starts[i].. into slots[i]; return last-token logits [B, V].

        Rows are right-padded; pads go to the trash column. For i in full_logits_rows also return the
        fp32 logits of every position of that row ([T_i, V]) for prompt logprobs.
        """
        m = self.context_length
        b = len(rows)
        t = max(len(r) for r in rows)
        ids = torch.zeros((b, t), dtype=torch.long)
        pos = torch.full((b, t), m, dtype=torch.long)  # pads -> trash column M
        for i, (r, s0) in enumerate(zip(rows, starts, strict=True)):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            pos[i, : len(r)] = torch.arange(s0, s0 + len(r))
        kv_len = max(s0 + len(r) for r, s0 in zip(rows, starts, strict=True))
        ids, pos = ids.to(self.device), pos.to(self.device)
        slot_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        hidden = self._forward(ids, pos, slot_t, kv_len, contiguous=False)  # [B, T, H]
        last = torch.tensor([len(r) - 1 for r in rows], device=self.device)
        last_logits = self.logits(hidden[torch.arange(b, device=self.device), last])  # [B, V]
        full: dict[int, torch.Tensor] = {}
        for i in full_logits_rows or ():
            full[i] = self.logits(hidden[i, : len(rows[i])])  # [T_i, V]
        return last_logits, full

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], num_slots: int) -> torch.Tensor:
        """One decode step over slots [0, num_slots): tokens[s] at positions[s] -> logits [num_slots, V].

        Idle slots pass position == context_length (the trash column) and any token.
        """
        kv_len = max((p + 1 for p in positions if p < self.context_length), default=1)
        if self.cuda_graphs:
            return self._decode_graph(tokens, positions, num_slots, kv_len)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]  # [B, 1]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)[:, None]
        slots = torch.arange(num_slots, device=self.device)
        hidden = self._forward(ids, pos, slots, kv_len, contiguous=True)  # [B, 1, H]
        return self.logits(hidden[:, 0])

    def _decode_graph(
        self, tokens: list[int], positions: list[int], num_slots: int, kv_len: int
    ) -> torch.Tensor:
        """Decode on static, bucketed buffers: replay a CUDA graph on CUDA, run the same shapes eagerly on CPU."""
        b = _bucket(num_slots, _BATCH_BUCKETS, self.max_slots)
        kv = _kv_bucket(kv_len, self.context_length)
        key = (b, kv)
        if key not in self._graphs:
            self._graphs[key] = self._capture(b, kv)
        graph, io = self._graphs[key]
        pad = b - num_slots
        io["ids"].copy_(torch.tensor(tokens + [0] * pad, dtype=torch.long)[:, None])  # [b, 1]
        io["pos"].copy_(torch.tensor(positions + [self.context_length] * pad, dtype=torch.long)[:, None])
        if graph is None:  # CPU: same static shapes, no capture (exercises this path in CPU tests)
            io["logits"] = self.logits(self._forward(io["ids"], io["pos"], io["slots"], kv, True)[:, 0])
        else:
            graph.replay()
        return io["logits"][:num_slots]

    def _capture(self, b: int, kv: int) -> tuple[torch.cuda.CUDAGraph | None, dict[str, torch.Tensor]]:
        io = {
            "ids": torch.zeros((b, 1), dtype=torch.long, device=self.device),  # [b, 1]
            "pos": torch.full((b, 1), self.context_length, dtype=torch.long, device=self.device),  # [b, 1]
            "slots": torch.arange(b, device=self.device),  # [b]
        }
        if self.device.type != "cuda":
            return None, io
        with torch.inference_mode():
            stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the graph (lazy inits, autotuning)
                    self.logits(self._forward(io["ids"], io["pos"], io["slots"], kv, True)[:, 0])
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                io["logits"] = self.logits(self._forward(io["ids"], io["pos"], io["slots"], kv, True)[:, 0])
            self._graph_pool = graph.pool()
        return graph, io

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy the KV of positions [0, length) of slot src into slot dst (prefix-cache reuse)."""
        self.k_cache[:, dst, :, :length].copy_(self.k_cache[:, src, :, :length])
        self.v_cache[:, dst, :, :length].copy_(self.v_cache[:, src, :, :length])
        if self.routes is not None:  # the prefix's routing travels with its KV
            self.routes[dst, :length].copy_(self.routes[src, :length])


def _is_moe_block(mlp: Any) -> bool:
    """True for a sparse MoE block in transformers' (>= 5) layout: a router `gate` returning
    (logits, gate values, expert IDs) and an `experts` module taking (hidden, IDs, gate values)."""
    gate = getattr(mlp, "gate", None)
    if gate is None or not hasattr(mlp, "experts"):
        return False
    if not hasattr(gate, "top_k"):
        raise NotImplementedError(
            f"{type(mlp).__name__}: this MoE block predates transformers 5's router/experts modules; "
            "the reference engine needs transformers >= 5 for MoE models"
        )
    if any(hasattr(mlp, a) for a in ("shared_expert", "shared_experts", "shared_expert_gate")):
        # _moe runs router + routed experts only; a shared-expert path would be silently dropped.
        raise NotImplementedError(
            f"{type(mlp).__name__}: MoE blocks with shared experts are not run by the reference engine yet "
            "(Qwen3-MoE-style blocks are: router + routed experts)"
        )
    return True


@torch.inference_mode()
def sample(
    logits: torch.Tensor,
    params: SamplingBatch,
    generator: torch.Generator,
    tiles: kernels.Tiles | None = None,
) -> tuple[list[int], list[float]]:
    """Sample one token per row of fp32 logits [B, V]; return (token ids, logprobs) per the module doc.

    With `tiles` (true on-policy) the returned logprob is kernels.token_logprobs, the trainer's.
    """
    temp = params.temperature
    greedy = temp < GREEDY_BELOW  # SGLang's rule: dividing by a smaller temperature overflows float32
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)[:, None]  # [B, V]
    logp = torch.log_softmax(scaled, dim=-1)  # [B, V]
    probs = logp.exp()
    if bool(((params.top_k > 0) & (params.top_k < logits.shape[-1])).any()) or bool((params.top_p < 1).any()):
        probs = _truncate(probs, params.top_k, params.top_p)
    ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    shared = [i for i, g in enumerate(params.generators) if g is None]
    if shared:
        idx = torch.tensor(shared, device=logits.device)
        ids[idx] = torch.multinomial(probs[idx], 1, generator=generator)[:, 0]
    for i, g in enumerate(params.generators):
        if g is not None:
            ids[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    ids = torch.where(greedy, logits.argmax(dim=-1), ids)
    if tiles is not None:
        one = torch.ones_like(temp)
        return ids.tolist(), kernels.token_logprobs(
            logits, ids, torch.where(greedy, one, temp), tiles
        ).tolist()
    lp = logp.gather(1, ids[:, None])[:, 0]
    return ids.tolist(), lp.tolist()


def _truncate(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens outside each row's top-k and top-p nucleus; [B, V] -> [B, V] (not renormalized)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, probs.shape[-1]))
    keep = rank < k[:, None]
    # Keep a token while the mass before it is below top_p (so the most likely token always stays).
    keep &= (sorted_p.cumsum(dim=-1) - sorted_p) < top_p[:, None]
    sorted_p = sorted_p * keep
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)
