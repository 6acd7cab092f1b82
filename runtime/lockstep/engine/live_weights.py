"""The reference engine's live weights: what an update may name, how it is checked, staged and copied
in, and the version that labels what is served.

Why it exists: a weight update must be all or nothing (every tensor checked before any live weight
moves), must write the parameters' own storage (CUDA graphs keep pointing at it), and must accept
what SGLang accepts: HF names, SGLang's per-expert names for fused experts, and for a low-precision
serving checkpoint its quantized weights and scales (dequantized here, lockstep.numerics.recipe).
The scheduler (scheduler.py) never sees any of this; it only reads the version each step.

Versions: an integer in [0, 2**63) that labels the weights served. It only moves forward for the
same weights; an older version is accepted only as the label of weights loaded since the last label
(a driver resumed from an earlier checkpoint, or restarted from the base policy, re-syncs a running
engine that way).

Who calls it: lockstep.engine.core (ReferenceEngine.load and its weights API).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from lockstep.engine.requests import EngineInputError
from lockstep.numerics import experts, quant, recipe
from lockstep.numerics.quant import Scheme

MAX_VERSION = 2**63
"""Weight versions are integers in [0, MAX_VERSION) (an int64 anywhere they are stored)."""

Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]
"""Tensor name -> (dtype, shape)."""


class LiveWeights:
    """The model's weights by name, onto live storage, with their version."""

    def __init__(self, model: Any, *, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        """The serving dtype (quantized weights are dequantized into it)."""
        self.version = 0
        """The version of the loaded weights; 0 at start."""
        self._unlabeled = False  # weights committed since the version was last set
        # Weights by HF name: parameters (incl. a tied lm_head) and the persistent buffers a checkpoint also
        # holds (GLM's router e_score_correction_bias), i.e. what the trainer's state dict exports.
        self._params = {**dict(model.named_parameters(remove_duplicate=False)), **persistent_buffers(model)}
        self.aliases: dict[str, torch.Tensor] = experts.views(self._params)
        """Names an update may also use, onto live storage: expert weights per expert and projection
        (SGLang's names, views into the fused 3-D parameters) and, NVFP4, each layer's input_scale."""
        self.scheme: Scheme | None = None
        """The serving weight format when the checkpoint was quantized (weights arrive quantized and
        are dequantized on load, lockstep.numerics.recipe.receive); None for bf16/fp32 serving."""
        self.quantized_layout: Layout = {}
        """For a quantized engine: (dtype, shape) of every tensor of the converted checkpoint that is
        quantized or a scale, i.e. what an update must announce for them (SGLang's layout)."""

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
        if v < self.version and not (new_weights or self._unlabeled):
            raise EngineInputError(
                f"weight_version {v} is older than the served version {self.version} of the "
                "same weights; versions only move forward (send the weights of that version with it)"
            )
        return v

    def set_version(self, version: int | str, *, new_weights: bool = False) -> None:
        """Set the version reported from now on (and recorded on tokens sampled from now on);
        raises EngineInputError unless check_version accepts it."""
        v = self.check_version(version, new_weights=new_weights)
        assert v is not None
        self.version = v
        self._unlabeled = False

    def named(self) -> dict[str, torch.Tensor]:
        """HF name -> live weight tensor: parameters (tied ones listed once, as HF state dict files do) and
        persistent buffers."""
        return {n: p.data for n, p in self.model.named_parameters()} | persistent_buffers(self.model)

    def update_layout(self) -> Layout:
        """(dtype, shape) of every tensor a full weight update carries, by SGLang's names: the weights
        as held, fused expert tensors as their per-expert weights (the weight pipeline sends them
        so), and for a quantized engine its quantized weights and scales in the converted
        checkpoint's layout."""
        out: Layout = {}
        for n, t in self.named().items():
            x = experts.parse(n)
            parts = experts.split(n, t) if x is not None and x.expert is None and t.dim() == 3 else [(n, t)]
            out.update({p: (v.dtype, tuple(v.shape)) for p, v in parts})
        return out | self.quantized_layout

    def _live(self, name: str) -> torch.Tensor | None:
        p = self._params.get(name)
        return self.aliases.get(name) if p is None else p

    @torch.no_grad()
    def stage(
        self, named: Iterable[tuple[str, torch.Tensor]], *, cast: bool = False, owned: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Validate every tensor of an update and stage it; the live weights are not touched.

        Returns (live parameter, staged tensor) pairs, the staged tensor already in the parameter's
        dtype, shape and device, so `commit` is plain same-layout copies. `owned`: the caller
        hands the tensors over (received or read for this update, or a CUDA IPC sender's buffers,
        which it leaves alone until the endpoint answers, after `commit`), so one already in the
        right layout is used as it is; otherwise it is copied.
        Raises KeyError on an unknown name and ValueError on a shape mismatch, or a dtype mismatch
        unless cast=True, naming the tensor; then nothing was changed. A quantized engine (`scheme`)
        first dequantizes what arrived with scales.
        """
        if self.scheme is not None:
            named = list(named)
            self._check_quantized_update(named)
            named = recipe.receive(named, self.scheme, self.dtype)
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, t in named:
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"load_weights: {name!r} is a {type(t).__name__}, not a tensor")
            p = self._live(name)
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
    def commit(self, staged: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Copy staged tensors into their parameters (same dtype, shape and device: nothing left to
        fail but the device itself). Call between steps, holding the step lock."""
        if staged:
            torch._foreach_copy_([live for live, _ in staged], [new for _, new in staged])
            for device in {live.device for live, _ in staged if live.is_cuda}:
                # done before the reply: a sender may reuse its buffer (CUDA IPC) once answered
                torch.cuda.current_stream(device).synchronize()
            self._unlabeled = True  # weights changed: the next version set labels them
        return len(staged)

    def receive_targets(
        self, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]
    ) -> list[torch.Tensor | None]:
        """Check an incoming update's metadata against the model before any data moves.

        specs: (HF name, dtype, shape) per tensor, as the request announces them. Returns, per tensor,
        the live parameter storage to receive into in place (same dtype, shape and device, contiguous),
        or None where the tensor must be staged and cast-copied (its dtype differs). Raises KeyError on
        an unknown name and ValueError on a shape mismatch, naming the tensor, for the whole request.
        Receiving into the returned tensors writes the live weights: call it holding the step lock.
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
            p = self._live(name)
            if p is None:
                raise KeyError(f"{name!r} is not a parameter of this model (HF names expected)")
            if tuple(shape) != tuple(p.shape):
                raise ValueError(f"{name} has shape {tuple(shape)}, the model's is {tuple(p.shape)}")
            live = p.data  # the parameter's own storage: CUDA graphs keep pointing at it
            in_place = dtype == live.dtype and live.device == self.device and live.is_contiguous()
            targets.append(live if in_place else None)
        return targets


def persistent_buffers(model: Any) -> dict[str, torch.Tensor]:
    """Buffers saved in the state dict (checkpoint tensors that are not parameters), by HF name."""
    saved = set(model.state_dict().keys())
    return {n: b for n, b in model.named_buffers() if n in saved}


def load_quantized(
    model: Any, path: Path, scheme: Scheme, dtype: torch.dtype, info: dict[str, Any]
) -> tuple[Layout, dict[str, torch.Tensor]]:
    """Overwrite `model`'s quantized weights (loaded by transformers from their raw bytes) with the
    exact dequantization of the checkpoint at `path` (per-expert weights into their slices of the
    fused experts); returns the layout of the quantized weights and their scales
    (LiveWeights.quantized_layout) and NVFP4's input scales by name. Raises naming what the
    checkpoint lacks."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    layout: Layout = {}
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
