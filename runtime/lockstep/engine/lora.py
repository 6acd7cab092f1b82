"""Multi-LoRA serving in the reference engine: base weights shared, one adapter per request.

Why it exists: SGLang started with --enable-lora serves many LoRA adapters on one base model, each
request naming its adapter (`lora_path` of /generate), which is how several RL jobs share one rollout
pool. The reference engine does the same so that LoRA jobs run, and are tested, without SGLang:
`AdapterSet` holds the loaded adapters by name and adds each one's low-rank update to the outputs of
the base linear layers it targets, row by row of the batch:

    out[rows of adapter a] += (x[rows] @ A_a^T) @ B_a^T * scaling_a     # x [n, T, in], A [r, in], B [out, r]

through forward hooks on the base modules (no module is replaced, so the weights keep their HF names
and the full-weight update endpoints are unchanged). Rows without an adapter see the base alone.
Before each step the scheduler calls `set_batch` with one adapter name (or None) per row.

Adapters arrive in peft's saved layout, as SGLang takes them: names
`base_model.model.<module>.lora_A.weight` ([r, in]) and `.lora_B.weight` ([out, r]) plus the peft
`adapter_config.json` (r, lora_alpha, target_modules, use_rslora). What SGLang refuses is refused
here, before anything is loaded: a rank above --max-lora-rank, a target outside --lora-target-modules,
a name already loaded, DoRA, a tensor whose shape does not fit its module.

Who calls it: lockstep.engine.core (the scheduler: which rows use which adapter),
lockstep.engine.lora_routes (load and unload), tests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

PEFT_PREFIX = "base_model.model."
"""peft's prefix of saved adapter names (SGLang accepts names with and without it)."""


class AdapterError(ValueError):
    """An adapter the engine cannot load or find; the message names the adapter and the fix."""


@dataclass(slots=True)
class LoadedAdapter:
    """One adapter held by the engine."""

    name: str
    """The name requests use (`lora_path`)."""
    rank: int
    """r."""
    scaling: float
    """alpha / r (alpha / sqrt(r) with rsLoRA)."""
    path: str
    """Where it was loaded from (`__tensor__` for tensors in the request), as SGLang reports it."""
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Base module name -> (A [r, in], B [out, r]) on the engine's device and dtype."""


def _module_of(name: str) -> tuple[str, str]:
    """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` -> (module, "A")."""
    n = name.removeprefix(PEFT_PREFIX)
    for part in ("A", "B"):
        marker = f".lora_{part}."
        if marker in n:
            module, rest = n.split(marker, 1)
            if rest.split(".")[-1] != "weight":
                break
            return module, part
    raise AdapterError(f"adapter tensor {name!r} is not a peft LoRA weight (<module>.lora_A|B.weight)")


class AdapterSet:
    """The adapters of one engine and the hooks that apply them (see the module doc)."""

    def __init__(
        self,
        model: Any,
        *,
        max_rank: int,
        target_modules: Sequence[str] | None = None,
        max_loaded: int | None = None,
    ) -> None:
        """model: the served HF causal LM; max_rank: SGLang's --max-lora-rank; target_modules: its
        --lora-target-modules (leaf names, or None / `all` for every linear layer, the output head too);
        max_loaded: --max-loaded-loras (None: no limit)."""
        if max_rank < 1:
            raise ValueError(f"--max-lora-rank {max_rank}: must be >= 1")
        self.max_rank = max_rank
        self.max_loaded = max_loaded
        allow = None if not target_modules or "all" in target_modules else set(target_modules)
        self.modules: dict[str, torch.nn.Linear] = {
            n: m
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and (allow is None or n.rsplit(".", 1)[-1] in allow)
        }
        """Base linear modules an adapter may target, by HF module name."""
        self.target_modules = sorted({n.rsplit(".", 1)[-1] for n in self.modules})
        """Their leaf names (what --lora-target-modules resolved to)."""
        self.adapters: dict[str, LoadedAdapter] = {}
        """Loaded adapters by name."""
        self._rows: dict[str, torch.Tensor] = {}  # adapter name -> batch row indices of this forward
        self._hooks = [m.register_forward_hook(self._hook(n)) for n, m in self.modules.items()]

    # -- loading ---------------------------------------------------------------------------------

    def build(
        self, name: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], *, path: str
    ) -> LoadedAdapter:
        """Validate and stage an adapter (not yet visible to requests); raises AdapterError naming it."""
        if name in self.adapters:
            raise AdapterError(
                f"Failed to load LoRA adapter {name} because it is already loaded (unload it, or load "
                "the new weights under a new name)"
            )
        if self.max_loaded is not None and len(self.adapters) >= self.max_loaded:
            raise AdapterError(
                f"{len(self.adapters)} adapters are loaded, the most --max-loaded-loras allows"
            )
        if config.get("use_dora"):
            raise AdapterError(f"Failed to load {name}: DoRA adapters are not served")
        try:
            rank = int(config["r"])
            alpha = float(config.get("lora_alpha", rank))
        except (KeyError, TypeError, ValueError) as e:
            raise AdapterError(f"adapter {name}: adapter_config needs integer r and lora_alpha ({e})") from e
        if not 1 <= rank <= self.max_rank:
            raise AdapterError(
                f"LoRA adapter {name} with rank {rank} is incompatible with this engine: its --max-lora-rank "
                f"is {self.max_rank} (start the engine with a larger --max-lora-rank, or train a smaller rank)"
            )
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for tname, t in tensors.items():
            module, part = _module_of(tname)
            parts.setdefault(module, {})[part] = t
        adapter = LoadedAdapter(name=name, rank=rank, scaling=scaling, path=path)
        for module, ab in sorted(parts.items()):
            base = self.modules.get(module)
            if base is None:
                leaf = module.rsplit(".", 1)[-1]
                raise AdapterError(
                    f"adapter {name} targets {module}, which is not among this engine's LoRA target modules "
                    f"{self.target_modules} (--lora-target-modules); {leaf!r} must be one of them"
                )
            if set(ab) != {"A", "B"}:
                raise AdapterError(f"adapter {name}: {module} has lora_{''.join(ab)} but not both A and B")
            a, b = ab["A"], ab["B"]
            want_a, want_b = (rank, base.in_features), (base.out_features, rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise AdapterError(
                    f"adapter {name}: {module} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                    f"the module (want {want_a} / {want_b} for rank {rank})"
                )
            w = base.weight
            adapter.weights[module] = (
                a.to(w.device, w.dtype).contiguous(),
                b.to(w.device, w.dtype).contiguous(),
            )
        if not adapter.weights:
            raise AdapterError(f"adapter {name} holds no LoRA tensors")
        return adapter

    def add(self, adapter: LoadedAdapter) -> None:
        """Make a built adapter visible to requests (call between steps)."""
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        """Forget an adapter (call between steps, once no request uses it)."""
        if self.adapters.pop(name, None) is None:
            raise AdapterError(f"LoRA adapter {name} is not loaded")

    def listing(self) -> dict[str, str]:
        """name -> path of every loaded adapter (SGLang's `loaded_adapters`)."""
        return {n: a.path for n, a in sorted(self.adapters.items())}

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The adapter's tensors under peft's saved names (for checks and tests)."""
        a = self.adapters[name]
        out: dict[str, torch.Tensor] = {}
        for module, (wa, wb) in a.weights.items():
            out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = wa
            out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = wb
        return out

    # -- applying --------------------------------------------------------------------------------

    def set_batch(self, names: Sequence[str | None], device: torch.device) -> None:
        """The adapter of each batch row for the next forward (None: the base alone)."""
        rows: dict[str, list[int]] = {}
        for i, n in enumerate(names):
            if n is not None:
                rows.setdefault(n, []).append(i)
        self._rows = {n: torch.tensor(r, dtype=torch.long, device=device) for n, r in rows.items()}

    def clear_batch(self) -> None:
        self._rows = {}

    def _hook(self, module: str) -> Any:
        def add_delta(
            _mod: torch.nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor
        ) -> torch.Tensor:
            if not self._rows:
                return out
            x = inputs[0]  # [B, T, in]
            for name, rows in self._rows.items():
                w = self.adapters[name].weights.get(module)
                if w is None:
                    continue
                a, b = w
                delta = (x.index_select(0, rows) @ a.T) @ b.T  # [n, T, r] -> [n, T, out]
                out = out.index_add(0, rows, delta, alpha=self.adapters[name].scaling)
            return out

        return add_delta

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
