"""The operator's pod commands parse with the runtime's own CLI (a contract between the two packages).

Why it exists: the operator renders `lockstep engine|driver|trainer ...` into pod specs without
importing the runtime; a renamed flag would only show up as crash-looping pods on a real cluster.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from lockstep.api import load_manifest
from lockstep.cli import build_parser
from lockstep_operator.resources.commands import driver_command, engine_command, trainer_command
from lockstep_operator.resources.common import CONTROL_PORT
from lockstep_operator.resources.model import local_dir, model_pull, pull_command

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
EXAMPLES_BY_NAME = {p.stem: p for p in EXAMPLES}


def _lockstep_args(cmd: list[str]) -> list[str]:
    """The arguments after `lockstep` (directly or through `lockstep launch [torchrun args] -m lockstep`)."""
    if cmd[:2] == ["lockstep", "launch"]:
        launch = build_parser().parse_args(cmd[1:])
        assert launch.torchrun_args == cmd[2:], cmd  # torchrun gets every argument unchanged
        i = cmd.index("-m")
        assert cmd[i : i + 2] == ["-m", "lockstep"], cmd
        return cmd[i + 2 :]
    assert cmd[0] == "lockstep", cmd
    return cmd[1:]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_pod_commands_parse_with_the_runtime_cli(path: Path) -> None:
    job = load_manifest(path)
    parser = build_parser()
    commands = [driver_command(), trainer_command()]
    if job.spec.rollout.engine.value == "reference":  # RolloutSpec is an EngineSpec
        commands.append(engine_command(job.spec.rollout, job.spec.model))
    for cmd in commands:
        args = parser.parse_args(_lockstep_args(cmd))
        assert callable(args.func), cmd
    # Trainer ranks take the RL steps for the driver pod (rank 0 serves them on the control port).
    trainer = parser.parse_args(_lockstep_args(trainer_command()))
    assert trainer.serve is True and trainer.port == CONTROL_PORT


@pytest.mark.parametrize("tokenizer", [None, "Qwen/Qwen3-4B@v1"])
def test_the_model_volume_init_step_parses_with_the_runtime_cli(tokenizer: str | None) -> None:
    """The operator's `lockstep pull-model REF --dest DIR` (resources.model) is the CLI's own contract."""
    job = load_manifest(EXAMPLES[0])
    model = job.spec.model.model_copy(update={"checkpoint": "Qwen/Qwen3-0.6B@main", "tokenizer": tokenizer})
    pull = model_pull(model, "runtime:test")
    assert pull is not None
    cmd = pull_command(pull)
    steps = [shlex.split(s) for s in cmd[2].split(" && ")] if cmd[0] == "sh" else [cmd]
    assert len(steps) == (1 if tokenizer is None else 2)
    parser = build_parser()
    for step, ref in zip(steps, pull.refs, strict=True):
        args = parser.parse_args(_lockstep_args(step))
        assert callable(args.func) and args.ref == ref and str(args.dest) == local_dir(ref)


@pytest.mark.parametrize("precision", ["fp8", "mxfp8", "nvfp4"])
def test_the_engine_pods_conversion_step_and_engine_command_agree_with_the_runtime(
    precision: str, tmp_path: Path
) -> None:
    """The operator's `lockstep convert-model ...` init step parses with the CLI and, run on a real
    checkpoint, writes what the engine command it renders then serves: the reference engine loads
    it and its --quantization matches the files (it exits otherwise)."""
    from lockstep.cli import main
    from lockstep.cli.engine import _check_quantization
    from lockstep.engine import ReferenceEngine
    from lockstep.models.tiny import materialize_builtin
    from lockstep_operator.resources.model import convert_command, model_convert, serving_model

    job = load_manifest(EXAMPLES_BY_NAME["tiny-local"])
    model = job.spec.model.model_copy(update={"checkpoint": "/models/tiny", "bf16_modules": ["*.o_proj"]})
    from lockstep.api import Precision

    engine = job.spec.rollout.model_copy(update={"precision": Precision(precision)})
    convert = model_convert(model, engine.precision, "runtime:test")
    assert convert is not None
    cmd = convert_command(convert)
    args = build_parser().parse_args(_lockstep_args(cmd))
    assert (str(args.src), str(args.dest), args.precision, args.bf16_modules) == (
        "/models/tiny", convert.dest, precision, ["*.o_proj"],
    )  # fmt: skip
    served = serving_model(model, engine.precision)
    rendered = engine_command(engine, served)
    assert rendered[rendered.index("--model") + 1] == convert.dest
    flag = rendered[rendered.index("--quantization") + 1]
    # the same step on this machine's disk: /models/tiny and /serving rebased under tmp_path
    src = materialize_builtin("builtin:tiny", tmp_path / "models", seed=0)
    dest = tmp_path / convert.dest.lstrip("/")
    dest.parent.mkdir(parents=True)
    assert main(["convert-model", str(src), "--dest", str(dest), *cmd[5:]]) == 0
    loaded = ReferenceEngine.load(dest, context_length=32)
    _check_quantization(flag, loaded.scheme)  # SystemExit when the flag and the files disagree
    assert loaded.scheme is not None and loaded.scheme.format.value == precision


def test_the_disk_delta_agent_sidecar_parses_with_the_runtime_cli() -> None:
    """An explicit disk-delta job's engine pods run `lockstep delta agent` (resources.delta_agent)."""
    from lockstep.cli.delta import agent_engine
    from lockstep.serving.membership import DELTA_AGENT_PORT
    from lockstep_operator.resources.delta_agent import AGENT_PORT, agent_command

    args = build_parser().parse_args(_lockstep_args(agent_command("job")))
    assert (
        args.delta_command == "agent" and args.port == AGENT_PORT == DELTA_AGENT_PORT and callable(args.func)
    )
    # The engine it reloads is the one on the pod IP Kubernetes substitutes, an IPv6 one in brackets.
    for pod_ip, engine in (("10.1.2.3", "http://10.1.2.3:30000"), ("fd00::5", "http://[fd00::5]:30000")):
        command = [pod_ip if a == "$(POD_IP)" else a for a in agent_command("job")]
        assert agent_engine(build_parser().parse_args(_lockstep_args(command))) == engine


def test_a_shared_pools_unload_pod_parses_with_the_runtime_cli() -> None:
    """A standalone pool's unload pod runs `lockstep unload-adapter` (resources.adapter_gc)."""
    from lockstep_operator.resources.adapter_gc import unload_pod
    from lockstep_operator.resources.common import Owner

    owner = Owner("rl.lockstep.dev/v1alpha1", "RolloutPool", "pool", "uid", "ns")
    engines = [{"status": {"podIP": "10.0.0.1"}}, {"status": {"podIP": "10.0.0.2"}}]
    cmd = unload_pod(owner, pool="pool", adapter="job-a", engines=engines, image="rt")["spec"]["containers"][
        0
    ]["command"]
    args = build_parser().parse_args(_lockstep_args(cmd))
    assert args.adapter == "job-a" and args.engine == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    assert callable(args.func)


def test_the_sglang_engine_pods_metrics_relay_parses_with_the_runtime_cli() -> None:
    """The sidecar of SGLang engine pods (resources.metrics_relay) is `lockstep metrics-relay`."""
    from lockstep_operator.resources.common import ENGINE_PORT, METRICS_PORT
    from lockstep_operator.resources.metrics_relay import relay_command

    args = build_parser().parse_args(_lockstep_args(relay_command()))
    assert callable(args.func) and args.port == METRICS_PORT and args.host == "$(POD_IP)"
    assert args.source == f"http://$(POD_IP):{ENGINE_PORT}/metrics"
