"""ReferenceEngine: continuous batching, prefix cache, pause modes and live weights, on torch only.

Why it exists: the runtime needs an engine that behaves like SGLang for RL (per-token logprobs and
weight versions, pause/retract around weight updates, a prefix cache) on machines without SGLang,
CPU included. This is its scheduler and its in-process API; lockstep.engine.server puts the SGLang
HTTP API in front of it.

How a step works (a scheduler task on the event loop; tensor work runs on one worker thread):
1. admit waiting sequences into free slots (up to max_prefill_tokens per step), reusing the KV of
   the longest cached token prefix: a free slot that holds it is taken in place, a running slot's
   prefix is copied; a sequence whose prompt shares a longer prefix with one admitted in the same
   step waits one step so it can reuse that KV;
2. prefill the admitted sequences together (right-padded), sample their next token;
3. decode every other running sequence together, one token each;
4. append tokens, logprobs and the current weight version; finish on a stop token, the budget or
   the context length; answer finished requests.
A finished sequence's slot keeps its KV as prefix cache until the slot is needed (LRU).

R3 (MoE models): a sequence submitted with return_routed_experts gets, when it finishes by stop or
length, the expert IDs the runner recorded for its tokens 0..n-2 (`Sequence.routed_experts`, int32
[n-1, layers, top-k]; n = prompt + output tokens). The last sampled token was never run through the
model, so it has no routing, as in SGLang. Aborted sequences carry none.

Pause modes (SGLang's): abort ends running and waiting requests; retract moves running sequences
back to the waiting queue keeping their tokens (their KV is recomputed after continue, under the
weights of that time, and later tokens carry the new version); in_place stops stepping and keeps KV.

Who calls it: lockstep.engine.server (HTTP), lockstep.engine.ext_weights (weights helper), tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from lockstep.engine.recompute import RecomputeRunner, slotted_runner_supports
from lockstep.engine.runner import ModelRunner, SamplingBatch, sample
from lockstep.models.loading import load_causal_lm
from lockstep.models.tokenizer import ChatTokenizer
from lockstep.numerics import exact, experts, quant, recipe
from lockstep.numerics.quant import Scheme
from lockstep.serving.payloads import SamplingParams

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]
MAX_VERSION = 2**63
"""Weight versions are integers in [0, MAX_VERSION) (an int64 anywhere they are stored)."""

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""SGLang's --kv-cache-dtype values -> the cache dtype (None: the model's)."""


class EngineInputError(ValueError):
    """A request the engine cannot serve; the message names the field and the fix (HTTP 400)."""


class EngineBusy(RuntimeError):
    """The queue is full or the engine is draining: retry later (HTTP 503 with Retry-After)."""


MAX_TOP_K = 2**31 - 1
"""top_k beyond the vocabulary keeps every token; larger values are refused before any kernel."""
MAX_STOP_TOKEN_IDS = 1024
"""stop_token_ids entries per request."""
SEED_RANGE = (-(2**63), 2**64)
"""sampling_seed must fit torch.Generator.manual_seed."""


@dataclass(slots=True)
class Sequence:
    """One request being generated. tokens = prompt + output; KV is valid for tokens[:kv_len]."""

    rid: str
    """Request ID."""
    prompt_len: int
    """P, the prompt length."""
    tokens: list[int]
    """Prompt then output token IDs."""
    params: SamplingParams
    """The request's sampling parameters."""
    stop_ids: frozenset[int]
    """Token IDs that end the sample."""
    max_new: int
    """Output budget (max_new_tokens capped by the context length)."""
    future: asyncio.Future[Sequence]
    """Resolved when the sequence finishes."""
    generator: torch.Generator | None = None
    """Seeded generator when sampling_seed is set."""
    input_logprob_start: int = -1
    """Prompt position from which prompt logprobs are returned; -1: none."""
    logprobs: list[float] = field(default_factory=list)
    """Logprob of each output token."""
    versions: list[int] = field(default_factory=list)
    """Weight version that sampled each output token."""
    input_logprobs: list[float | None] | None = None
    """Prompt-token logprobs from input_logprob_start (first entry None at position 0)."""
    slot: int = -1
    """Owned KV slot, -1 when waiting."""
    kv_len: int = 0
    """Tokens whose KV is in the slot."""
    cached_tokens: int = -1
    """Prompt tokens reused from the prefix cache at first admission; -1 before admission."""
    finish: dict[str, Any] | None = None
    """SGLang finish_reason JSON once finished."""
    abort_requested: bool = False
    """Set by /abort_request; handled between steps."""
    created: float = 0.0
    """time.monotonic() at submit, for e2e_latency."""
    return_routed_experts: bool = False
    """R3: record the routed expert IDs of this sequence's tokens (MoE models only)."""
    routed_experts: bytes | None = None
    """R3 payload once finished by stop or length: int32 [n-1, layers, top-k], little-endian."""

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass(slots=True)
class _Plan:
    """The tensor work of one step, built on the event loop and run on the worker thread."""

    copies: list[tuple[int, int, int]]
    """(src slot, dst slot, length) prefix copies before prefill."""
    prefill: list[Sequence]
    """Sequences to prefill from their kv_len."""
    decode: list[Sequence]
    """Running sequences to advance one token."""
    version: int
    """The weight version of this step."""


@dataclass(slots=True)
class EngineStats:
    """Counters since start (exposed at GET /engine_stats)."""

    prompt_tokens: int = 0
    """Prompt tokens of admitted requests."""
    cached_tokens: int = 0
    """Of those, tokens reused from the prefix cache."""
    generated_tokens: int = 0
    """Tokens sampled."""
    steps: int = 0
    """Scheduler steps run."""
    requests: int = 0
    """Requests finished (any reason)."""
    failed_steps: int = 0
    """Steps that raised (their sequences were aborted with the error)."""

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _lcp(a: list[int], b: list[int], cap: int) -> int:
    n = min(len(a), len(b), cap)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ReferenceEngine:
    """See the module doc. Create with `ReferenceEngine.load(dir)`, then `await engine.start()`."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        model_path: str = "",
        tokenizer: ChatTokenizer | None = None,
        device: str | torch.device = "cpu",
        max_running_requests: int = 32,
        context_length: int = 1024,
        max_prefill_tokens: int = 16384,
        seed: int = 0,
        cuda_graphs: bool | None = None,
        max_queued_requests: int = 1024,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """model: an HF Qwen3ForCausalLM on `device`; max_running_requests: KV slots (sequences run
        together); context_length: longest prompt + output; max_prefill_tokens: prompt tokens admitted per
        step; seed: the engine generator's seed (requests without sampling_seed); cuda_graphs: decode on
        static buffers, captured into CUDA graphs on CUDA (default: on for CUDA). With graphs, parameters
        must never be rebound (`p.data = t`), only copied into, as load_weights does.
        max_queued_requests: sequences waiting or running at once; beyond it submit raises EngineBusy.
        kv_cache_dtype: SGLang's --kv-cache-dtype (`fp8_e4m3`/`fp8_e5m2` store K/V in FP8, scale 1.0).
        """
        self.device = torch.device(device)
        """Where the weights and the KV cache live."""
        self.model_path = model_path
        """The checkpoint dir loaded at start."""
        self.tokenizer = tokenizer
        """The checkpoint's tokenizer (decodes output text); None when the dir has none (text is empty)."""
        self.model: Any = model.eval()
        """The transformers causal LM holding the live weights under HF names."""
        self.weight_version: int = 0
        """The version of the loaded weights; 0 at start."""
        self.stats = EngineStats()
        """Counters, including the prefix-cache hit rate."""
        self.max_prefill_tokens = max_prefill_tokens
        self.max_queued_requests = max_queued_requests
        """Sequences waiting or running at once; more are refused with EngineBusy (HTTP 503)."""
        self._unlabeled = False  # weights committed since the version was last set
        self.draining = False
        """Set on shutdown: new requests are refused with EngineBusy, /health answers 503."""
        dtype = next(model.parameters()).dtype
        # Qwen3-style attention runs on the slotted KV cache; other architectures recompute (recompute.py).
        runner_cls: Any = ModelRunner if slotted_runner_supports(model.config) else RecomputeRunner
        self.runner = runner_cls(
            model,
            max_slots=max_running_requests,
            context_length=context_length,
            device=self.device,
            dtype=dtype,
            seed=seed,
            cuda_graphs=self.device.type == "cuda" if cuda_graphs is None else cuda_graphs,
            kv_cache_dtype=KV_CACHE_DTYPES[kv_cache_dtype],
        )
        # Weights by HF name: parameters (incl. a tied lm_head) and the persistent buffers a checkpoint also
        # holds (GLM's router e_score_correction_bias), i.e. what the trainer's state dict exports.
        self._params = {**dict(model.named_parameters(remove_duplicate=False)), **_persistent_buffers(model)}
        self._aliases: dict[str, torch.Tensor] = experts.views(self._params)
        """Names an update may also use, onto live storage: expert weights per expert and projection
        (SGLang's names, views into the fused 3-D parameters) and, NVFP4, each layer's input_scale."""
        self.scheme: Scheme | None = None
        """The serving weight format when the checkpoint was quantized (weights arrive quantized and
        are dequantized on load, lockstep.numerics.recipe.receive); None for bf16/fp32 serving."""
        self.quantized_layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        """For a quantized engine: (dtype, shape) of every tensor of the converted checkpoint that is
        quantized or a scale, i.e. what an update must announce for them (SGLang's layout)."""
        self._eos = _eos_ids(model.config)
        self._waiting: deque[Sequence] = deque()
        self._running: dict[int, Sequence] = {}  # slot -> sequence
        self._slot_tokens: list[list[int]] = [
            [] for _ in range(max_running_requests)
        ]  # valid KV of free slots
        self._slot_used = [0] * max_running_requests  # LRU clock per slot
        self._clock = itertools.count(1)
        self._by_rid: dict[str, Sequence] = {}
        self._paused = False
        self._lock = asyncio.Lock()  # held for every step and every weight/pause operation
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lockstep-engine")
        self._task: asyncio.Task[None] | None = None
        self.weight_group: Any = None
        """The open /init_weights_update_group group (a lockstep.serving.WeightUpdateGroup) or None."""

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        true_on_policy: bool = False,
        **kwargs: Any,
    ) -> ReferenceEngine:
        """Load an HF-layout checkpoint dir through transformers' auto classes (fp32 on CPU, bf16 on CUDA
        unless dtype is given); its tokenizer.json, when present, decodes output text.

        true_on_policy: run the trainer's batch-invariant kernels (lockstep.numerics.exact), SGLang's
        --enable-deterministic-inference --rl-on-policy-target fsdp.
        """
        from transformers import AutoConfig

        path = Path(path)
        dev = torch.device(device)
        dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        config = AutoConfig.from_pretrained(path)
        scheme = recipe.checkpoint_scheme(json.loads((path / "config.json").read_text()))
        model: Any
        if scheme is None:
            model = load_causal_lm(path, config=config, dtype=dtype)
        else:  # a low-precision serving checkpoint: dequantize exactly what it holds (seed §6, stage 4)
            # transformers loads every tensor kept in BF16 (and maps checkpoint names onto its modules,
            # e.g. per-expert weights onto fused experts); the quantized ones are then overwritten
            # with their exact dequantization (their raw bytes never serve)
            del config.quantization_config
            loaded: Any = load_causal_lm(
                path, config=config, dtype=dtype, ignore_mismatched_sizes=True, output_loading_info=True
            )
            model, info = loaded
            layout, input_scales = _load_quantized(model, path, scheme, dtype, info)
        model = model.to(dev)
        if true_on_policy:
            exact.apply(model, dev)
        has_tokenizer = (path / "tokenizer.json").is_file()
        tok = ChatTokenizer.load(path, require_template=False) if has_tokenizer else None
        ctx = kwargs.pop("context_length", None) or min(
            int(getattr(config, "max_position_embeddings", 1024)), 4096
        )
        engine = cls(model, model_path=str(path), tokenizer=tok, device=dev, context_length=ctx, **kwargs)
        engine.scheme = scheme
        if scheme is not None:
            engine.quantized_layout = layout
            # NVFP4 is w4a4: the activations are quantized under the input scales that arrived
            scales = {n: t.to(dev) for n, t in input_scales.items()}
            if scales:
                engine._aliases.update(scales)
                recipe.install_activations(model, scales)
        return engine

    @property
    def context_length(self) -> int:
        return int(self.runner.context_length)

    @property
    def vocab_size(self) -> int:
        return int(self.runner.vocab_size)

    @property
    def is_moe(self) -> bool:
        """True when the model has sparse MoE layers (R3 routing data can be returned)."""
        return self.runner.routes is not None

    async def start(self) -> None:
        """Start the scheduler task on the running event loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="lockstep-engine-scheduler")

    async def close(self) -> None:
        """Stop the scheduler, abort what is left, release the worker thread and the weight group."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._abort_all("engine shut down")
        group, self.weight_group = self.weight_group, None
        if group is not None:
            group.close()
        # Never wait here for a worker stuck in a collective (a sender that died mid-update): the
        # process exits around it (lockstep.cli.engine bounds the whole shutdown).
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def run_in_worker(self, fn: Any, *args: Any) -> Any:
        """Run fn(*args) on the engine's tensor thread (serialized with steps)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- weights API (stable; the weights helper relies on it) ---------------------------------

    def check_version(self, version: int | str | None, *, new_weights: bool = False) -> int | None:
        """The version an update may set, or None when it names none; raises EngineInputError.

        A version is an integer in [0, 2**63) that labels the weights served. It only moves forward
        for the same weights: relabeling them with an older version is refused. An older version is
        accepted only as the label of weights loaded since the last label (`new_weights`: this update
        brings them; or a bucketed update already committed them), which is how a driver resumed from
        an earlier checkpoint, or restarted from the base policy, re-syncs a running engine.
        Checked before any weight moves.
        """
        if version is None:
            return None
        try:
            v = int(version)
        except (TypeError, ValueError) as e:
            raise EngineInputError(
                f"weight_version {version!r}: the reference engine uses non-negative integer versions"
            ) from e
        if not 0 <= v < MAX_VERSION:
            raise EngineInputError(f"weight_version {v}: must be in [0, 2**63)")
        if v < self.weight_version and not (new_weights or self._unlabeled):
            raise EngineInputError(
                f"weight_version {v} is older than the served version {self.weight_version} of the "
                "same weights; versions only move forward (send the weights of that version with it)"
            )
        return v

    def set_weight_version(self, version: int | str, *, new_weights: bool = False) -> None:
        """Set the version reported from now on (and recorded on tokens sampled from now on);
        raises EngineInputError unless check_version accepts it."""
        v = self.check_version(version, new_weights=new_weights)
        assert v is not None
        self.weight_version = v
        self._unlabeled = False

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF name -> live weight tensor: parameters (tied ones listed once, as HF state dict files do) and
        persistent buffers."""
        return {n: p.data for n, p in self.model.named_parameters()} | _persistent_buffers(self.model)

    def update_layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """(dtype, shape) of every tensor a full weight update carries, by SGLang's names: the weights
        as held, fused expert tensors as their per-expert weights (the weight pipeline sends them
        so), and for a quantized engine its quantized weights and scales in the converted
        checkpoint's layout."""
        out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for n, t in self.named_weights().items():
            x = experts.parse(n)
            parts = experts.split(n, t) if x is not None and x.expert is None and t.dim() == 3 else [(n, t)]
            out.update({p: (v.dtype, tuple(v.shape)) for p, v in parts})
        return out | self.quantized_layout

    @torch.no_grad()
    def stage_weights(
        self, named: Iterable[tuple[str, torch.Tensor]], *, cast: bool = False, owned: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Validate every tensor of an update and stage it; the live weights are not touched.

        Returns (live parameter, staged tensor) pairs, the staged tensor already in the parameter's
        dtype, shape and device, so `commit_weights` is plain same-layout copies. `owned`: the caller
        hands the tensors over (received or read for this update), so one already in the right
        layout is used as it is; otherwise (shared memory the sender may still write) it is copied.
        Raises KeyError on an unknown name and ValueError on a shape mismatch, or a dtype mismatch
        unless cast=True, naming the tensor; then nothing was changed. A quantized engine (`scheme`)
        first dequantizes what arrived with scales.
        """
        if self.scheme is not None:
            named = list(named)
            self._check_quantized_update(named)
            named = recipe.receive(named, self.scheme, self.runner.dtype)
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, t in named:
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"load_weights: {name!r} is a {type(t).__name__}, not a tensor")
            p = self._params.get(name)
            if p is None:
                p = self._aliases.get(name)
            if p is None:
                raise KeyError(f"load_weights: {name!r} is not a parameter of this model (HF names expected)")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(
                    f"load_weights: {name} has shape {tuple(t.shape)}, the model's is {tuple(p.shape)}"
                )
            if t.dtype != p.dtype and not cast:
                raise ValueError(
                    f"load_weights: {name} has dtype {t.dtype}, the model's is {p.dtype}; convert first"
                )
            same = t.dtype == p.dtype and t.device == p.device and t.is_contiguous()
            staged.append((p.data, t if owned and same else t.to(p.device, p.dtype, copy=True)))
        return staged

    def _check_quantized_update(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """A quantized weight and its scales arrive together and in the converted checkpoint's
        dtype and shape (they are bytes to dequantize, never values to cast); raises naming them."""
        units: dict[str, set[str]] = {}
        for name, t in named:
            held = self.quantized_layout.get(name)
            if held is None:
                continue
            if (t.dtype, tuple(t.shape)) != held:
                raise ValueError(
                    f"load_weights: {name} arrives as {str(t.dtype).removeprefix('torch.')} {list(t.shape)}; "
                    f"this engine serves {self.scheme} and takes {str(held[0]).removeprefix('torch.')} "
                    f"{list(held[1])} (the converted checkpoint's layout)"
                )
            units.setdefault(name.rsplit(".", 1)[0], set()).add(name)
        wanted: dict[str, set[str]] = {}
        for n in self.quantized_layout if units else ():
            wanted.setdefault(n.rsplit(".", 1)[0], set()).add(n)
        for module, got in units.items():
            want = wanted[module]
            if got != want:
                raise ValueError(
                    f"load_weights: {module} is quantized and needs {', '.join(sorted(want))} in one update; "
                    f"{', '.join(sorted(want - got))} missing (a weight and its scales travel together)"
                )

    @torch.no_grad()
    def commit_weights(self, staged: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Copy staged tensors into their parameters (same dtype, shape and device: nothing left to
        fail but the device itself). Call between steps, holding `exclusive()`."""
        for live, new in staged:
            live.copy_(new)
        if staged:
            self._unlabeled = True  # weights changed: the next version set labels them
        return len(staged)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, cast: bool = False) -> int:
        """Copy tensors into the live parameters by HF name, all or nothing; return how many.

        Every tensor is checked and staged first (`stage_weights`), then copied (`commit_weights`):
        an unknown name (KeyError) or a shape or dtype mismatch (ValueError) anywhere leaves every
        weight as it was. Call between steps (inside `exclusive()` or holding no requests).
        """
        return self.commit_weights(self.stage_weights(named, cast=cast))

    def receive_targets(
        self, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]
    ) -> list[torch.Tensor | None]:
        """Check an incoming update's metadata against the model before any data moves.

        specs: (HF name, dtype, shape) per tensor, as the request announces them. Returns, per tensor,
        the live parameter storage to receive into in place (same dtype, shape and device, contiguous),
        or None where the tensor must be staged and cast-copied (its dtype differs). Raises KeyError on
        an unknown name and ValueError on a shape mismatch, naming the tensor, for the whole request.
        Receiving into the returned tensors writes the live weights: call it holding `exclusive()`.
        """
        targets: list[torch.Tensor | None] = []
        for name, dtype, shape in specs:
            held = self.quantized_layout.get(name)
            if held is not None:  # a quantized weight or its scale: staged, then dequantized (receive)
                if (dtype, tuple(shape)) != held:
                    raise ValueError(
                        f"{name} arrives as {str(dtype).removeprefix('torch.')} {list(shape)}; this engine "
                        f"serves {self.scheme} and takes it as {str(held[0]).removeprefix('torch.')} "
                        f"{list(held[1])} (the converted checkpoint's layout)"
                    )
                targets.append(None)
                continue
            p = self._params.get(name)
            if p is None:
                p = self._aliases.get(name)
            if p is None:
                raise KeyError(f"{name!r} is not a parameter of this model (HF names expected)")
            if tuple(shape) != tuple(p.shape):
                raise ValueError(f"{name} has shape {tuple(shape)}, the model's is {tuple(p.shape)}")
            live = p.data  # the parameter's own storage: CUDA graphs keep pointing at it
            in_place = dtype == live.dtype and live.device == self.device and live.is_contiguous()
            targets.append(live if in_place else None)
        return targets

    @contextlib.asynccontextmanager
    async def paused(self, mode: PauseMode = "retract") -> AsyncIterator[None]:
        """`async with engine.paused():` no step runs inside; the prefix cache is flushed on exit."""
        await self.pause(mode)
        try:
            yield
        finally:
            self.flush_cache()
            await self.resume()

    # -- requests ------------------------------------------------------------------------------

    def new_sequence(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        logprob_start_len: int = -1,
        return_routed_experts: bool = False,
    ) -> Sequence:
        """Validate a request and build its Sequence (raises EngineInputError)."""
        self._validate(input_ids, params, logprob_start_len)
        if return_routed_experts and not self.is_moe:
            raise EngineInputError(
                "return_routed_experts: this is a dense model, there are no routed experts"
            )
        stop = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop |= self._eos
        gen = None
        if params.sampling_seed is not None:
            gen = torch.Generator(device=self.device)
            try:
                gen.manual_seed(params.sampling_seed)
            except (RuntimeError, OverflowError, ValueError) as e:
                raise EngineInputError(f"sampling_params.sampling_seed {params.sampling_seed}: {e}") from e
        return Sequence(
            rid=rid or uuid.uuid4().hex,
            prompt_len=len(input_ids),
            tokens=list(input_ids),
            params=params,
            stop_ids=frozenset(stop),
            max_new=min(params.max_new_tokens, self.context_length - len(input_ids)),
            future=asyncio.get_running_loop().create_future(),
            generator=gen,
            input_logprob_start=logprob_start_len,
            created=time.monotonic(),
            return_routed_experts=return_routed_experts,
        )

    def _validate(self, ids: list[int], p: SamplingParams, logprob_start_len: int) -> None:
        if not ids:
            raise EngineInputError("input_ids is empty; send at least one prompt token")
        if len(ids) >= self.context_length:
            raise EngineInputError(
                f"input_ids has {len(ids)} tokens; the context length is {self.context_length} "
                "(shorten the prompt or start the engine with a larger --context-length)"
            )
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise EngineInputError(f"input_ids contains {bad}, outside the vocabulary [0, {self.vocab_size})")
        if p.stop:
            raise EngineInputError("sampling_params.stop (stop strings) is not supported; use stop_token_ids")
        if p.min_p:
            raise EngineInputError(
                "sampling_params.min_p is not supported by the reference engine; use top_p/top_k"
            )
        _check_sampling(p)
        if logprob_start_len >= len(ids):
            raise EngineInputError(
                f"logprob_start_len {logprob_start_len} must be < the prompt length {len(ids)}"
            )

    async def submit(self, seq: Sequence) -> Sequence:
        """Queue a sequence and wait until it finishes (a finished Sequence carries finish)."""
        return (await self.submit_many([seq]))[0]

    async def submit_many(self, seqs: list[Sequence]) -> list[Sequence]:
        """Queue sequences all or none (EngineInputError on a duplicate rid, EngineBusy when they do
        not fit), then wait until every one finishes."""
        rids = [s.rid for s in seqs]
        dup = next((r for r in rids if r in self._by_rid), None)
        if dup is not None or len(set(rids)) != len(rids):
            raise EngineInputError(f"rid {dup!r} is already running; request IDs must be unique")
        self.check_capacity(len(seqs))
        for seq in seqs:
            self._by_rid[seq.rid] = seq
            self._waiting.append(seq)
        self._wake.set()
        return list(await asyncio.gather(*(self._wait(s) for s in seqs)))

    async def _wait(self, seq: Sequence) -> Sequence:
        try:
            return await asyncio.shield(seq.future)
        except asyncio.CancelledError:  # the HTTP client went away: stop spending steps on it
            if seq.finish is None:
                self._finish(seq, {"type": "abort", "message": "client disconnected"})
            raise
        finally:
            self._by_rid.pop(seq.rid, None)

    def check_capacity(self, n: int) -> None:
        """Raise EngineBusy unless `n` more sequences fit the queue (and the engine is not draining)."""
        if self.draining:
            raise EngineBusy("the engine is shutting down; send the request to another engine")
        queued = len(self._by_rid)
        if queued + n > self.max_queued_requests:
            raise EngineBusy(
                f"{queued} requests queued or running, {n} more would pass max_queued_requests "
                f"{self.max_queued_requests}; retry later"
            )

    async def abort(self, rid: str | None = None, *, message: str = "aborted by /abort_request") -> None:
        """Abort one request (by rid) or all; their replies carry finish_reason type abort."""
        async with self._lock:
            if rid is None:
                self._abort_all(message)
                return
            seq = self._by_rid.get(rid)
            if seq is not None and seq.finish is None:
                self._finish(seq, {"type": "abort", "message": message})

    def _abort_all(self, message: str) -> None:
        for seq in [*self._waiting, *self._running.values()]:
            self._finish(seq, {"type": "abort", "message": message})

    # -- pause / continue / cache ------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "retract") -> None:
        """Stop stepping after the current step; see the module doc for the modes."""
        if mode not in ("abort", "retract", "in_place"):
            raise EngineInputError(f"mode={mode!r}: use abort, retract or in_place")
        async with self._lock:
            self._paused = True
            if mode == "abort":
                self._abort_all("aborted by /pause_generation")
            elif mode == "retract":
                for slot in sorted(self._running, reverse=True):
                    seq = self._running.pop(slot)
                    self._slot_tokens[slot] = seq.tokens[: seq.kv_len]  # still valid until weights change
                    seq.slot, seq.kv_len = -1, 0
                    self._waiting.appendleft(seq)

    async def resume(self) -> None:
        """Continue after pause (SGLang's /continue_generation)."""
        self._paused = False
        self._wake.set()

    @property
    def is_paused(self) -> bool:
        return self._paused

    def flush_cache(self) -> int:
        """Forget the cached KV of every free slot; returns how many were dropped."""
        n = 0
        for s in range(self.runner.max_slots):
            if s not in self._running and self._slot_tokens[s]:
                self._slot_tokens[s] = []
                n += 1
        return n

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the step lock: no step runs inside (weight updates use this)."""
        async with self._lock:
            yield

    # -- scheduler -------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if self._paused or not (self._waiting or self._running):
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._lock:
                if self._paused:
                    continue
                self._reap_aborted()
                plan = self._plan()
                if plan.prefill or plan.decode:
                    try:
                        results = await self.run_in_worker(self._execute, plan)
                    except Exception as e:  # never leave requests waiting on a dead scheduler
                        self._fail_step(plan, e)
                    else:
                        self._apply(plan, results)
            # Let handlers (abort, pause, new requests) in between steps; back off if nothing ran.
            await asyncio.sleep(0 if plan.prefill or plan.decode else 0.005)

    def _fail_step(self, plan: _Plan, error: Exception) -> None:
        """A step raised: log it, abort the sequences it touched (their KV is unknown), keep serving."""
        log.exception("engine step failed; aborting %d sequences", len(plan.prefill) + len(plan.decode))
        self.stats.failed_steps += 1
        for seq in [*plan.prefill, *plan.decode]:
            if seq.finish is None:
                self._finish(
                    seq, {"type": "abort", "message": f"engine step failed: {type(error).__name__}: {error}"}
                )
            slot = seq.slot
            self._release(seq)
            if slot >= 0:
                self._slot_tokens[slot] = []  # the step may have half-written this KV

    def _reap_aborted(self) -> None:
        for seq in [s for s in self._running.values() if s.finish is not None]:
            self._release(seq)

    def _free_slot(self, avoid: set[int]) -> int | None:
        free = [s for s in range(self.runner.max_slots) if s not in self._running and s not in avoid]
        if not free:
            return None
        return min(
            free, key=lambda s: (bool(self._slot_tokens[s]), self._slot_used[s])
        )  # empty first, then LRU

    def _plan(self) -> _Plan:
        copies: list[tuple[int, int, int]] = []
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        taken: set[int] = set()
        deferred: list[Sequence] = []
        while self._waiting and budget > 0:
            seq = self._waiting[0]
            cap = len(seq.tokens) - 1  # the last token is always recomputed, for its logits
            if seq.input_logprob_start >= 0:
                cap = min(cap, max(seq.input_logprob_start - 1, 0))
            best, best_len = -1, 0
            for s in range(self.runner.max_slots):
                if s in taken:
                    continue
                run = self._running.get(s)  # a running slot's KV is valid for its tokens[:kv_len]
                if run is None:
                    n = _lcp(self._slot_tokens[s], seq.tokens, cap)
                else:
                    n = _lcp(run.tokens, seq.tokens, min(cap, run.kv_len))
                if n > best_len:
                    best, best_len = s, n
            if any(_lcp(a.tokens, seq.tokens, cap) > best_len for a in admitted):
                deferred.append(self._waiting.popleft())  # reuse that KV next step
                continue
            if best >= 0 and best not in self._running:
                slot: int | None = best
            else:
                slot = self._free_slot(taken | ({best} if best >= 0 else set()))
                if slot is not None and best >= 0:
                    copies.append((best, slot, best_len))
            if slot is None:
                break
            self._waiting.popleft()
            taken.add(slot)
            budget -= len(seq.tokens) - best_len
            seq.slot, seq.kv_len = slot, best_len
            self._slot_tokens[slot] = []  # while running, the sequence describes the slot
            if seq.cached_tokens < 0:
                seq.cached_tokens = best_len
                self.stats.prompt_tokens += seq.prompt_len
                self.stats.cached_tokens += best_len
            admitted.append(seq)
        self._waiting.extendleft(reversed(deferred))
        decode = [s for s in self._running.values() if s.finish is None]
        for seq in admitted:
            self._running[seq.slot] = seq
        return _Plan(copies=copies, prefill=admitted, decode=decode, version=self.weight_version)

    def _execute(self, plan: _Plan) -> tuple[list[int], list[float], dict[int, list[float | None]]]:
        """Worker thread: run the plan's tensor work; returns (tokens, logprobs) for prefill then decode."""
        runner = self.runner
        for src, dst, n in plan.copies:
            runner.copy_prefix(src, dst, n)
        logits: list[torch.Tensor] = []
        seqs: list[Sequence] = []
        prompt_lp: dict[int, list[float | None]] = {}
        if plan.prefill:
            rows = [s.tokens[s.kv_len :] for s in plan.prefill]
            want = {
                i
                for i, s in enumerate(plan.prefill)
                if s.input_logprob_start >= 0 and s.input_logprobs is None
            }
            last, full = runner.prefill(
                rows, [s.kv_len for s in plan.prefill], [s.slot for s in plan.prefill], want
            )
            for i, lg in full.items():
                prompt_lp[i] = _prompt_logprobs(plan.prefill[i], lg)
            keep = [i for i, s in enumerate(plan.prefill) if s.max_new > len(s.output_ids)]
            logits.append(last[keep])
            seqs.extend(plan.prefill[i] for i in keep)
        if plan.decode:
            n = max(s.slot for s in plan.decode) + 1
            toks, pos = [0] * n, [runner.context_length] * n
            for s in plan.decode:
                toks[s.slot], pos[s.slot] = s.tokens[-1], len(s.tokens) - 1
            out = runner.decode(toks, pos, n)
            logits.append(out[torch.tensor([s.slot for s in plan.decode], device=out.device)])
            seqs.extend(plan.decode)
        if not seqs:
            return [], [], prompt_lp
        params = SamplingBatch(
            temperature=torch.tensor([s.params.temperature for s in seqs], device=self.device),
            top_p=torch.tensor([s.params.top_p for s in seqs], device=self.device),
            top_k=torch.tensor([s.params.top_k for s in seqs], device=self.device),
            generators=[s.generator for s in seqs],
        )
        ids, lps = sample(torch.cat(logits), params, runner.generator, runner.tiles)
        return ids, lps, prompt_lp

    def _apply(
        self, plan: _Plan, results: tuple[list[int], list[float], dict[int, list[float | None]]]
    ) -> None:
        ids, lps, prompt_lp = results
        self.stats.steps += 1
        for i, plp in prompt_lp.items():
            plan.prefill[i].input_logprobs = plp
        for seq in plan.prefill:
            seq.kv_len = len(seq.tokens)
        for seq in plan.decode:
            seq.kv_len = len(seq.tokens)
        sampled = [s for s in plan.prefill if s.max_new > len(s.output_ids)] + plan.decode
        for seq, tok, lp in zip(sampled, ids, lps, strict=True):
            if seq.finish is not None:  # aborted while the step ran
                continue
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(plan.version)
            self.stats.generated_tokens += 1
            if tok in seq.stop_ids:
                self._finish(seq, {"type": "stop", "matched": tok})
            elif len(seq.output_ids) >= seq.max_new:
                self._finish(seq, {"type": "length", "length": seq.max_new})
        for seq in plan.prefill:
            if seq.finish is None and seq.max_new <= len(seq.output_ids):
                self._finish(seq, {"type": "length", "length": seq.max_new})
        for seq in [*plan.prefill, *plan.decode]:
            if seq.slot >= 0:
                self._slot_used[seq.slot] = next(self._clock)
            if seq.finish is not None:
                if seq.return_routed_experts and seq.slot >= 0 and seq.finish.get("type") != "abort":
                    # The worker is idle here (steps run under the lock), so the slot's routing is stable.
                    seq.routed_experts = self.runner.read_routes(seq.slot, len(seq.tokens) - 1)
                self._release(seq)

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        seq.finish = reason
        if seq.slot < 0 and seq in self._waiting:
            self._waiting.remove(seq)
        if not seq.future.done():
            seq.future.set_result(seq)
        self.stats.requests += 1

    def _release(self, seq: Sequence) -> None:
        if seq.slot >= 0 and self._running.get(seq.slot) is seq:
            del self._running[seq.slot]
            self._slot_tokens[seq.slot] = seq.tokens[: seq.kv_len]
        seq.slot = -1


def _prompt_logprobs(seq: Sequence, logits: torch.Tensor) -> list[float | None]:
    """logits [T, V] over tokens[kv_len:] -> logprobs of prompt tokens from input_logprob_start.

    Like SGLang's input_token_logprobs (Req.temp_scaled_logprobs is False by default): log_softmax of
    the raw logits, without the request's temperature.
    """
    logp = torch.log_softmax(logits, dim=-1)  # [T, V]
    start = seq.input_logprob_start
    out: list[float | None] = []
    for pos in range(start, seq.prompt_len):
        if pos == 0:
            out.append(None)  # nothing predicts the first token
            continue
        row = pos - 1 - seq.kv_len
        out.append(float(logp[row, seq.tokens[pos]]))
    return out


def _persistent_buffers(model: Any) -> dict[str, torch.Tensor]:
    """Buffers saved in the state dict (checkpoint tensors that are not parameters), by HF name."""
    saved = set(model.state_dict().keys())
    return {n: b for n, b in model.named_buffers() if n in saved}


def _eos_ids(config: Any) -> set[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


def _check_sampling(p: SamplingParams) -> None:
    """Bounds of every sampling parameter, checked before a kernel sees it (EngineInputError naming
    the field); one request's bad value must never fail a batch it shares with others."""
    for name in ("temperature", "top_p", "min_p"):
        value = getattr(p, name)
        if not math.isfinite(value):
            raise EngineInputError(f"sampling_params.{name} is {value}; send a finite number")
    if p.top_k != -1 and not 1 <= p.top_k <= MAX_TOP_K:
        raise EngineInputError(f"sampling_params.top_k {p.top_k}: use -1 (all tokens) or 1..{MAX_TOP_K}")
    if p.max_new_tokens > 2**31:
        raise EngineInputError(f"sampling_params.max_new_tokens {p.max_new_tokens}: at most 2**31")
    if p.stop_token_ids is not None and len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise EngineInputError(
            f"sampling_params.stop_token_ids has {len(p.stop_token_ids)} entries; at most {MAX_STOP_TOKEN_IDS}"
        )
    if p.sampling_seed is not None and not SEED_RANGE[0] <= p.sampling_seed < SEED_RANGE[1]:
        raise EngineInputError(f"sampling_params.sampling_seed {p.sampling_seed}: must fit 64 bits")


def _load_quantized(
    model: Any, path: Path, scheme: Scheme, dtype: torch.dtype, info: dict[str, Any]
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, torch.Tensor]]:
    """Overwrite `model`'s quantized weights (loaded by transformers from their raw bytes) with the
    exact dequantization of the checkpoint at `path` (per-expert weights into their slices of the
    fused experts); returns the layout of the quantized weights and their scales
    (ReferenceEngine.quantized_layout) and NVFP4's input scales by name. Raises naming what the
    checkpoint lacks."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    units: list[tuple[str, quant.Quantized]] = []
    for name in tensors:
        q, used = quant.from_checkpoint(name, tensors, scheme) if name.endswith(".weight") else (None, [])
        if q is not None:
            units.append((name, q))
            layout.update({n: (tensors[n].dtype, tuple(tensors[n].shape)) for n in used})
    params = dict(model.named_parameters())  # tied lm_head listed once, as the checkpoint has it
    views = experts.views(params)
    with torch.no_grad():
        for name, q in units:
            target = params.get(name, views.get(name))
            if target is None:
                raise KeyError(f"{path}: {name!r} is not a parameter of {type(model).__name__}")
            target.copy_(quant.dequantize(q, dtype))
    loaded = {n for n, _ in units}
    loaded |= {
        n for n, t in params.items() if experts.parse(n) and t.dim() == 3
        and all(e in loaded for e, _ in experts.split(n, t))
    }  # fmt: skip
    missing = sorted(set(info.get("missing_keys") or ()) - loaded)
    mismatched = sorted({str(m[0]) for m in info.get("mismatched_keys") or ()} - loaded)
    if missing or mismatched:
        raise ValueError(f"{path}: the quantized checkpoint lacks {', '.join((missing + mismatched)[:5])}")
    # NVFP4 is w4a4 with each layer's input_scale; a checkpoint without one gets SGLang's default (1.0)
    input_scales = {
        f"{name.removesuffix('.weight')}.input_scale": q.input_scale.float().reshape(())
        for name, q in units
        if q.input_scale is not None
    }
    return layout, input_scales
