"""ReferenceEngine: continuous batching, prefix cache, pause modes and live weights, on torch only.

Why it exists: the runtime needs an engine that behaves like SGLang for RL (per-token logprobs and
weight versions, pause/retract around weight updates, a prefix cache) on machines without SGLang,
CPU included. This is its in-process API, which wires three parts together and owns the one worker
thread all tensor work runs on:
- scheduler.py: the step loop (admission with prefix reuse, prefill, decode, finish), pause modes,
  aborts, the queue bound; slots.py: which request holds which of the runner's KV slots;
- live_weights.py: weights by name, the all-or-nothing update path, the weight version;
- runner.py / recompute.py: the model forward over the KV slots, and sampling.
requests.py holds a request's Sequence and its validation. lockstep.engine.server puts the SGLang HTTP
API in front of this class.

Who calls it: lockstep.engine.server (HTTP), lockstep.engine.ext_weights (weights helper), tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from lockstep.engine.context_limits import fit_context
from lockstep.engine.live_weights import MAX_VERSION, Layout, LiveWeights, load_quantized
from lockstep.engine.lora import AdapterSet
from lockstep.engine.recompute import RecomputeRunner, slotted_runner_supports
from lockstep.engine.requests import (
    EngineBusy,
    EngineInputError,
    EngineStats,
    Sequence,
    validate,
    validate_scoring,
)
from lockstep.engine.runner import ModelRunner
from lockstep.engine.scheduler import PauseMode, Scheduler
from lockstep.models.loading import load_causal_lm
from lockstep.models.tokenizer import ChatTokenizer
from lockstep.numerics import exact, recipe
from lockstep.serving.payloads import SamplingParams

__all__ = [
    "KV_CACHE_DTYPES",
    "MAX_VERSION",
    "EngineBusy",
    "EngineInputError",
    "EngineStats",
    "PauseMode",
    "ReferenceEngine",
    "Sequence",
]

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""SGLang's --kv-cache-dtype values -> the cache dtype (None: the model's)."""


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
        allow_auto_truncate: bool = False,
    ) -> None:
        """model: an HF Qwen3ForCausalLM on `device`; max_running_requests: KV slots (sequences run
        together); context_length: longest prompt + output; max_prefill_tokens: prompt tokens admitted per
        step; seed: the engine generator's seed (requests without sampling_seed); cuda_graphs: decode on
        static buffers, captured into CUDA graphs on CUDA (default: on for CUDA). With graphs, parameters
        must never be rebound (`p.data = t`), only copied into, as load_weights does.
        max_queued_requests: sequences waiting or running at once; beyond it submit raises EngineBusy.
        kv_cache_dtype: SGLang's --kv-cache-dtype (`fp8_e4m3`/`fp8_e5m2` store K/V in FP8, scale 1.0).
        allow_auto_truncate: SGLang's --allow-auto-truncate: a request beyond the context is cut to fit
        instead of refused (lockstep.engine.context_limits).
        """
        self.allow_auto_truncate = allow_auto_truncate
        """Cut requests beyond the context to fit (SGLang's --allow-auto-truncate) instead of a 400."""
        self.device = torch.device(device)
        """Where the weights and the KV cache live."""
        self.model_path = model_path
        """The checkpoint dir loaded at start."""
        self.tokenizer = tokenizer
        """The checkpoint's tokenizer (decodes output text); None when the dir has none (text is empty)."""
        self.model: Any = model.eval()
        """The transformers causal LM holding the live weights under HF names."""
        dtype = next(model.parameters()).dtype
        self.weights = LiveWeights(self.model, device=self.device, dtype=dtype)
        """The live weights, their update path and their version."""
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
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lockstep-engine")
        self.scheduler = Scheduler(
            self.runner,
            device=self.device,
            version=lambda: self.weights.version,
            run_in_worker=self.run_in_worker,
            max_prefill_tokens=max_prefill_tokens,
            max_queued_requests=max_queued_requests,
        )
        """The step loop over the runner's slots."""
        self._eos = _eos_ids(model.config)
        self.weight_group: Any = None
        """The open /init_weights_update_group group (a lockstep.serving.WeightUpdateGroup) or None."""
        self._unloading: set[str] = set()  # LoRA adapters new requests may no longer name

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
        else:  # a low-precision serving checkpoint: dequantize exactly what it holds (§6, stage 4)
            # transformers loads every tensor kept in BF16 (and maps checkpoint names onto its modules,
            # e.g. per-expert weights onto fused experts); the quantized ones are then overwritten
            # with their exact dequantization (their raw bytes never serve)
            del config.quantization_config
            loaded: Any = load_causal_lm(
                path, config=config, dtype=dtype, ignore_mismatched_sizes=True, output_loading_info=True
            )
            model, info = loaded
            layout, input_scales = load_quantized(model, path, scheme, dtype, info)
        model = model.to(dev)
        if true_on_policy:
            exact.apply(model, dev)
        has_tokenizer = (path / "tokenizer.json").is_file()
        tok = ChatTokenizer.load(path, require_template=False) if has_tokenizer else None
        ctx = kwargs.pop("context_length", None) or min(
            int(getattr(config, "max_position_embeddings", 1024)), 4096
        )
        engine = cls(model, model_path=str(path), tokenizer=tok, device=dev, context_length=ctx, **kwargs)
        engine.weights.scheme = scheme
        if scheme is not None:
            engine.weights.quantized_layout = layout
            # NVFP4 is w4a4: the activations are quantized under the input scales that arrived
            scales = {n: t.to(dev) for n, t in input_scales.items()}
            if scales:
                engine.weights.aliases.update(scales)
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

    @property
    def stats(self) -> EngineStats:
        """Counters since start, including the prefix-cache hit rate."""
        return self.scheduler.stats

    @property
    def max_queued_requests(self) -> int:
        """Sequences waiting or running at once; more are refused with EngineBusy (HTTP 503)."""
        return self.scheduler.max_queued_requests

    @property
    def draining(self) -> bool:
        """Set on shutdown: new requests are refused with EngineBusy, /health answers 503."""
        return self.scheduler.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.scheduler.draining = value

    async def start(self) -> None:
        """Start the scheduler task on the running event loop."""
        await self.scheduler.start()

    async def close(self) -> None:
        """Stop the scheduler, abort what is left, release the worker thread and the weight group."""
        await self.scheduler.stop("engine shut down")
        group, self.weight_group = self.weight_group, None
        if group is not None:
            group.close()
        # Never wait here for a worker stuck in a collective (a sender that died mid-update): the
        # process exits around it (lockstep.cli.engine bounds the whole shutdown).
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def run_in_worker(self, fn: Any, *args: Any) -> Any:
        """Run fn(*args) on the engine's tensor thread (serialized with steps)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- weights API (stable; the weights helper relies on it; live_weights.py documents each) ------

    @property
    def weight_version(self) -> int:
        """The version of the loaded weights; 0 at start."""
        return self.weights.version

    @property
    def scheme(self) -> Any:
        """The serving weight format of a quantized checkpoint (LiveWeights.scheme), else None."""
        return self.weights.scheme

    @property
    def quantized_layout(self) -> Layout:
        """LiveWeights.quantized_layout."""
        return self.weights.quantized_layout

    def check_version(self, version: int | str | None, *, new_weights: bool = False) -> int | None:
        """The version an update may set, or None when it names none; raises EngineInputError."""
        return self.weights.check_version(version, new_weights=new_weights)

    def set_weight_version(self, version: int | str, *, new_weights: bool = False) -> None:
        """Set the version reported from now on (and recorded on tokens sampled from now on)."""
        self.weights.set_version(version, new_weights=new_weights)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF name -> live weight tensor (parameters, tied ones once, and persistent buffers)."""
        return self.weights.named()

    def update_layout(self) -> Layout:
        """(dtype, shape) of every tensor a full weight update carries, by SGLang's names."""
        return self.weights.update_layout()

    def stage_weights(
        self, named: Iterable[tuple[str, torch.Tensor]], *, cast: bool = False, owned: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Validate every tensor of an update and stage it; the live weights are not touched."""
        return self.weights.stage(named, cast=cast, owned=owned)

    def commit_weights(self, staged: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Copy staged tensors into their parameters. Call between steps, holding `exclusive()`."""
        return self.weights.commit(staged)

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
        """Check an incoming update's metadata before any data moves; the live storage to receive
        into in place, or None to stage. Call it holding `exclusive()`."""
        return self.weights.receive_targets(specs)

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
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | None = None,
        adapter: str | None = None,
    ) -> Sequence:
        """Validate a request and build its Sequence (raises EngineInputError).

        top_logprobs_num / token_ids_logprob score prompt positions (lockstep.engine.scoring); this
        engine serves them for scoring requests only (max_new_tokens 0, logprob_start_len >= 0)."""
        self._check_adapter(adapter)
        input_ids, max_new = fit_context(  # SGLang's 400 beyond the context, unless auto-truncating
            input_ids,
            params.max_new_tokens,
            self.context_length,
            allow_auto_truncate=self.allow_auto_truncate,
        )
        validate(
            input_ids,
            params,
            logprob_start_len,
            context_length=self.context_length,
            vocab_size=self.vocab_size,
        )
        validate_scoring(
            params, logprob_start_len, top_logprobs_num, token_ids_logprob, vocab_size=self.vocab_size
        )
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
            max_new=max_new,
            future=asyncio.get_running_loop().create_future(),
            generator=gen,
            input_logprob_start=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            token_ids_logprob=list(token_ids_logprob) if token_ids_logprob is not None else None,
            created=time.monotonic(),
            return_routed_experts=return_routed_experts,
            adapter=adapter,
        )

    # -- LoRA adapters (SGLang's --enable-lora; lockstep.engine.lora) ----------------------------

    @property
    def adapters(self) -> AdapterSet | None:
        """The LoRA adapters served on the base; None while LoRA is off."""
        return self.scheduler.adapters

    def enable_lora(
        self, *, max_rank: int, target_modules: list[str] | None = None, max_loaded: int | None = None
    ) -> AdapterSet:
        """Serve LoRA adapters on the base (SGLang's --enable-lora --max-lora-rank --lora-target-modules
        --max-loaded-loras). CUDA graphs are switched off: each step's adapter rows vary."""
        self.scheduler.adapters = AdapterSet(
            self.model, max_rank=max_rank, target_modules=target_modules, max_loaded=max_loaded
        )
        self.runner.cuda_graphs = False
        return self.scheduler.adapters

    def _check_adapter(self, adapter: str | None) -> None:
        if adapter is None:
            return
        if self.adapters is None:
            raise EngineInputError(
                f"lora_path {adapter!r}: LoRA is not enabled; start the engine with --enable-lora"
            )
        if adapter not in self.adapters.adapters or adapter in self._unloading:
            raise EngineInputError(
                f"lora_path {adapter!r} is not loaded (loaded: {sorted(self.adapters.adapters)}); "
                "load it with /load_lora_adapter first"
            )

    def adapter_in_use(self, name: str) -> bool:
        """Whether a waiting or running request samples with adapter `name`."""
        s = self.scheduler
        return any(q.adapter == name for q in [*s.waiting, *s.slots.running.values()])

    async def unload_adapter(self, name: str, poll_s: float = 0.01) -> None:
        """SGLang's unload: new requests may no longer name the adapter; once the requests that use it
        have finished it is removed, and the prefix cache built with it is dropped. Raises
        EngineInputError when it is not loaded."""
        if self.adapters is None or name not in self.adapters.adapters:
            raise EngineInputError(f"LoRA adapter {name} is not loaded")
        self._unloading.add(name)
        try:
            while self.adapter_in_use(name):
                await asyncio.sleep(poll_s)
            async with self.scheduler.lock:
                self.adapters.remove(name)
                self.scheduler.slots.drop_adapter(name)
        finally:
            self._unloading.discard(name)

    async def submit(self, seq: Sequence) -> Sequence:
        """Queue a sequence and wait until it finishes (a finished Sequence carries finish)."""
        return (await self.submit_many([seq]))[0]

    async def submit_many(self, seqs: list[Sequence]) -> list[Sequence]:
        """Queue sequences all or none (EngineInputError on a duplicate rid, EngineBusy when they do
        not fit), then wait until every one finishes."""
        return await self.scheduler.submit_many(seqs)

    def check_capacity(self, n: int) -> None:
        """Raise EngineBusy unless `n` more sequences fit the queue (and the engine is not draining)."""
        self.scheduler.check_capacity(n)

    @property
    def queued(self) -> int:
        """Sequences waiting or running now."""
        return len(self.scheduler.by_rid)

    async def abort(self, rid: str | None = None, *, message: str = "aborted by /abort_request") -> None:
        """Abort one request (by rid) or all; their replies carry finish_reason type abort."""
        await self.scheduler.abort(rid, message)

    # -- pause / continue / cache ------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "retract") -> None:
        """Stop stepping after the current step; scheduler.py's doc describes the modes."""
        await self.scheduler.pause(mode)

    async def resume(self) -> None:
        """Continue after pause (SGLang's /continue_generation)."""
        self.scheduler.resume()

    @property
    def is_paused(self) -> bool:
        return self.scheduler.paused

    def flush_cache(self) -> int:
        """Forget the cached KV of every free slot; returns how many were dropped."""
        return self.scheduler.slots.flush()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the step lock: no step runs inside (weight updates use this)."""
        async with self.scheduler.lock:
            yield


def _eos_ids(config: Any) -> set[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}
