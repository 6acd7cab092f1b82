"""Container commands of the runtime roles, derived from the parsed spec (pure).

Why it exists: which binary a pod runs is a contract with the runtime (the `lockstep` CLI
subcommands) and with SGLang (`python3 -m sglang.launch_server`, its flags in resources.sglang); it is
written in one place and tested against both parsers. Called by the RolloutPool, TrainerGroup and RLJob reconciles.
"""

from __future__ import annotations

from lockstep.api.profiles import SGLANG_QUANTIZATION
from lockstep.api.rljob import EngineSpec, ModelSpec

from lockstep_operator.resources.common import CONFIG_FILE, CONFIG_MOUNT, ENGINE_PORT, POD_IP_ENV
from lockstep_operator.resources.sglang import SGLANG_START, Disaggregation, lora_flags, sglang_command

CONFIG_PATH = f"{CONFIG_MOUNT}/{CONFIG_FILE}"
POD_IP = f"$({POD_IP_ENV})"
"""Engines bind the pod IP (Kubernetes expands the downward-API env var), never all interfaces."""


def engine_command(
    engine: EngineSpec,
    model: ModelSpec,
    *,
    r3: bool = False,
    true_on_policy: bool = False,
    disaggregation: Disaggregation | None = None,
) -> list[str]:
    """SGLang's server for `sglang` (resources.sglang, behind SGLANG_START which hands it the key),
    Lockstep's reference engine for `reference`.

    The reference engine needs no flag for R3 or true-on-policy: it returns routed experts on request
    and its kernels are the trainer's own.
    """
    if engine.engine.value == "reference":
        # The flags of `lockstep engine` (runtime/lockstep/cli/engine.py); runtime/tests/test_pod_commands.py
        # parses every pod command with the runtime's own CLI.
        cmd = [
            "lockstep", "engine",
            "--model", model.checkpoint,
            "--device", "cuda" if engine.gpus_per_engine > 0 else "cpu",
            "--host", POD_IP,
            "--port", str(ENGINE_PORT),
        ]  # fmt: skip
        if engine.precision in SGLANG_QUANTIZATION:  # checked against the converted checkpoint at start
            cmd += ["--quantization", SGLANG_QUANTIZATION[engine.precision]]
        return cmd + lora_flags(model)  # the same LoRA flags as SGLang's
    sglang = sglang_command(
        engine, model, r3=r3, true_on_policy=true_on_policy, disaggregation=disaggregation
    )
    return [*SGLANG_START, *sglang]


def trainer_command() -> list[str]:
    """torchrun over the rank pod's GPUs (rendezvous from the PET_* env of the pod), serving the driver.

    `lockstep launch` is torchrun with its rendezvous store bound to the pod IP (plain torchrun's
    listens on every interface; lockstep.trainer.rendezvous says why). `--serve`: the ranks take the RL steps; rank 0 listens for the driver's commands on the control
    port (the CLI's default, 29600 = resources.common.CONTROL_PORT).
    """
    return ["lockstep", "launch", "-m", "lockstep", "trainer", "--config", CONFIG_PATH, "--serve"]


def driver_command() -> list[str]:
    """The RL loop."""
    return ["lockstep", "driver", "--config", CONFIG_PATH]
