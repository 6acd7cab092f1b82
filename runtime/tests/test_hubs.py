"""No hub: a runtime module imports at most MAX_IMPORTS of our modules, or is a listed exception.

Why: a module that imports many of our modules couples them all (a change to any one of them reaches
it, and it cannot be read without them); docs/engineering.md states the rule and why each exception
stays. The count is grimp's (the graph import-linter's contracts use): every module directly imported,
type-only imports included. An exception's number is its ceiling: it may shrink, not grow.
"""

from __future__ import annotations

import grimp
import pytest

MAX_IMPORTS = 12
"""Most of our modules one runtime module may import directly."""

EXCEPTIONS = {
    "lockstep.driver.components": (
        20,
        "the driver's composition root: Components names every part of a run (and SIGTERM's state)",
    ),
    "lockstep.cli.precision": (
        17,
        "`lockstep precision-check` runs engine, trainer and transport end to end",
    ),
    "lockstep.weights.factory": (17, "the one place that knows every weight transport (it builds them)"),
    "lockstep.trainer.local": (15, "the RL train step: the shared loss, schedule, OPD, R3 and packing"),
    "lockstep.trainer.server": (
        17,
        "rank 0's command server: every command a trainer group runs, its metrics and SIGTERM's notices",
    ),
    "lockstep.train.fsdp.backend": (15, "the FSDP backend: load, LoRA, checkpoint, kernels, logprobs"),
    "lockstep.driver.sft": (14, "the SFT job's loop: rows, trainer, metrics, progress and checkpoints"),
    "lockstep.config.trainer": (14, "the trainer side's manifest mapping: it builds each config it imports"),
    "lockstep.train.megatron.backend": (13, "the Megatron backend: model, parallelism, state, export, R3"),
    "lockstep.rollout.session.server": (13, "the session server: TITO sessions over the serving modules"),
}
"""Module -> (its most imports, why it stays over MAX_IMPORTS)."""


def import_counts() -> dict[str, int]:
    """Our modules each runtime module imports directly."""
    graph = grimp.build_graph("lockstep")
    return {m: len(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


@pytest.fixture(scope="module")
def counts() -> dict[str, int]:
    return import_counts()


def test_no_runtime_module_is_a_hub(counts: dict[str, int]) -> None:
    hubs = {m: n for m, n in counts.items() if n > EXCEPTIONS.get(m, (MAX_IMPORTS, ""))[0]}
    assert not hubs, (
        f"these modules import more than {MAX_IMPORTS} of our modules (or more than their listed "
        "exception): split them by concern, or list a real exception with its reason here and in "
        "docs/engineering.md: " + ", ".join(f"{m} ({n})" for m, n in sorted(hubs.items()))
    )


def test_every_exception_is_still_needed(counts: dict[str, int]) -> None:
    stale = {m: counts.get(m, 0) for m in EXCEPTIONS if counts.get(m, 0) <= MAX_IMPORTS}
    assert not stale, "these modules are within the rule now: remove their exceptions: " + ", ".join(stale)


if __name__ == "__main__":
    for module, n in sorted(import_counts().items(), key=lambda kv: -kv[1])[:20]:
        print(n, module)
