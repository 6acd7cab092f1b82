"""Every SGLang command the operator renders parses with SGLang's own ServerArgs parser, as the spec asked.

The expected values are written here from the spec, independently of the renderer: a renamed flag
fails in SGLang's parser, a flag rendered with the wrong value fails the comparison.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from lockstep.api import load_manifest
from lockstep.api.profiles import profile_for
from lockstep.api.rljob import EngineSpec, KVCacheDtype, LoraSpec, ModelSpec, Precision
from lockstep.api.rolloutpool import RolloutPoolSpec
from lockstep_operator.resources.children import child_manifests
from lockstep_operator.resources.common import API_KEY_ENV, ENGINE_PORT, Owner
from lockstep_operator.resources.engines import engine_manifest
from lockstep_operator.resources.model import local_model, serving_dir
from lockstep_operator.resources.sglang import SGLANG_START, Disaggregation, sglang_command
from sglang_oracle import FlagError, checkpoint_quant_method, parse_server_args, require_pinned_sglang

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples").glob("*.yaml"))
LAUNCH = ["python3", "-m", "sglang.launch_server"]
OWNER = Owner(
    api_version="rl.lockstep.dev/v1alpha1", kind="RolloutPool", name="job-rollout", uid="u", namespace="ns"
)


@pytest.fixture(autouse=True, scope="module")
def _pinned() -> None:
    require_pinned_sglang()


def expected(
    engine: EngineSpec, model: ModelSpec, *, r3: bool, top: bool, pd: Disaggregation | None
) -> dict[str, Any]:
    """What SGLang must have parsed for this spec (ServerArgs field -> value)."""
    quant = {
        Precision.BF16: None,
        Precision.FP8: "fp8",
        Precision.MXFP8: "mxfp8",
        Precision.NVFP4: "modelopt_fp4",  # the converted checkpoint's format (ModelOpt NVFP4)
    }
    return {
        "model_path": model.checkpoint,
        "tokenizer_path": model.tokenizer,
        "host": "$(POD_IP)",  # the pod IP from the downward API, expanded by the kubelet
        "port": ENGINE_PORT,
        "tp_size": engine.tensor_parallel,
        "attn_dp_size": engine.data_parallel_attention,
        "dp_size": 1,  # replicas are pods, never SGLang's in-process data parallelism
        "quantization": quant[engine.precision],
        "kv_cache_dtype": engine.kv_cache_dtype.value,
        "enable_return_routed_experts": r3,
        "enable_deterministic_inference": top,
        "rl_on_policy_target": "fsdp" if top else None,
        # the registered profile's attention (the API refuses true on-policy for other models)
        "attention_backend": "fa3" if top and profile_for(model.family, model.variant) else None,
        "disaggregation_mode": pd or "null",
        "speculative_algorithm": "EAGLE" if engine.multi_token_prediction else None,
        "weight_version": "0",
        "api_key": None,  # never a flag: the start step passes it in SGLang's --config (test_engine_key.py)
        "enable_lora": True if model.lora else None,
        "max_lora_rank": model.lora.rank if model.lora else None,
        "lora_target_modules": (
            None
            if model.lora is None
            else ["all"]
            if "all-linear" in model.lora.target_modules
            else list(model.lora.target_modules)
        ),
    }


def assert_parses_as_asked(
    cmd: list[str],
    engine: EngineSpec,
    model: ModelSpec,
    *,
    r3: bool = False,
    top: bool = False,
    pd: Disaggregation | None = None,
) -> None:
    if cmd[: len(SGLANG_START)] == list(SGLANG_START):  # the pod's command: the start step, then SGLang
        cmd = cmd[len(SGLANG_START) :]
    assert cmd[:3] == LAUNCH, cmd
    parsed = parse_server_args(cmd[3:])
    want = expected(engine, model, r3=r3, top=top, pd=pd)
    got = {k: getattr(parsed, k) for k in want}
    if got["tokenizer_path"] == model.checkpoint and want["tokenizer_path"] is None:
        got["tokenizer_path"] = None  # SGLang may default the tokenizer to the model path
    assert got == want, f"{cmd}: SGLang parsed {got}, the spec asked {want}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_engine_pod_command_parses(path: Path) -> None:
    """Each example as the operator runs it: RLJob -> RolloutPool child -> engine pod -> its command."""
    job = load_manifest(path)
    if job.spec.rollout.engine.value != "sglang":
        pytest.skip("reference engine: runtime/tests/test_pod_commands.py parses it with our CLI")
    job_owner = Owner(
        api_version=OWNER.api_version, kind="RLJob", name=job.metadata.name, uid="u", namespace="ns"
    )
    pool_doc = next(
        m
        for m in child_manifests(job_owner, job.spec, suspended=False, stopped="")
        if m["kind"] == "RolloutPool"
    )
    pool = RolloutPoolSpec.model_validate(pool_doc["spec"])
    pod = engine_manifest(OWNER, pool, 0, gang_min=1, image="img")
    cmd = pod["spec"]["containers"][0]["command"]
    served = local_model(job.spec.model)
    if job.spec.rollout.precision is not Precision.BF16:  # the conversion step's directory
        served = served.model_copy(
            update={"checkpoint": serving_dir(job.spec.model, job.spec.rollout.precision)}
        )
        [convert] = [c for c in pod["spec"]["initContainers"] if c["name"] == "convert-model"]
        assert convert["command"][convert["command"].index("--dest") + 1] == served.checkpoint
    assert_parses_as_asked(  # a hub id is served from the model volume the init step fills
        cmd,
        job.spec.rollout,
        served,
        r3=job.spec.algorithm.r3,
        top=job.spec.algorithm.true_on_policy,
    )
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env[API_KEY_ENV]["valueFrom"]["secretKeyRef"] == {
        "name": f"{job.metadata.name}-api-key",
        "key": "api-key",
    }


MODEL = ModelSpec(checkpoint="/models/glm", family="glm5", tokenizer="/models/glm-tok")

# One case per value of every knob the API offers, each next to rotating values of the others, plus
# everything on at once: every flag is rendered and parsed at least once, alone and combined.
KNOBS: dict[str, list[Any]] = {
    "tensor_parallel": [1, 4, 8],
    "data_parallel_attention": [1, 2, 8],
    "precision": list(Precision),
    "kv_cache_dtype": list(KVCacheDtype),
    "multi_token_prediction": [False, True],
    "r3": [False, True],
    "top": [False, True],
    "pd": [None, "prefill", "decode"],
}


def _cases() -> list[dict[str, Any]]:
    cases = []
    for knob, values in KNOBS.items():
        for i, value in enumerate(values):
            case = {k: v[(i + j) % len(v)] for j, (k, v) in enumerate(KNOBS.items())}
            case[knob] = value
            cases.append(case)
    cases.append({k: v[-1] for k, v in KNOBS.items()})
    for case in cases:  # DP attention must divide tensor parallel (rule engine-dpa-divides-tp)
        case["tensor_parallel"] = max(case["tensor_parallel"], case["data_parallel_attention"])
    return cases


@pytest.mark.parametrize("case", _cases(), ids=lambda c: "-".join(str(v) for v in c.values()))
def test_every_combination_the_api_offers_parses(case: dict[str, Any]) -> None:
    engine = EngineSpec(
        engine="sglang",
        gpus_per_engine=case["tensor_parallel"],
        tensor_parallel=case["tensor_parallel"],
        data_parallel_attention=case["data_parallel_attention"],
        precision=case["precision"],
        kv_cache_dtype=case["kv_cache_dtype"],
        multi_token_prediction=case["multi_token_prediction"],
        prefill_decode=case["pd"] is not None,
    )
    cmd = sglang_command(engine, MODEL, r3=case["r3"], true_on_policy=case["top"], disaggregation=case["pd"])
    assert_parses_as_asked(cmd, engine, MODEL, r3=case["r3"], top=case["top"], pd=case["pd"])


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj", "lm_head"]])
def test_a_lora_model_renders_sglangs_lora_serving_flags(targets: list[str]) -> None:
    """spec.model.lora -> --enable-lora --max-lora-rank R --lora-target-modules (all for all-linear)."""
    model = MODEL.model_copy(update={"lora": LoraSpec(rank=32, target_modules=targets)})
    engine = EngineSpec(engine="sglang")
    assert_parses_as_asked(sglang_command(engine, model), engine, model)


def test_extra_args_reach_sglang_verbatim() -> None:
    engine = EngineSpec(engine="sglang", extra_args=["--mem-fraction-static", "0.7"])
    parsed = parse_server_args(sglang_command(engine, MODEL)[3:])
    assert parsed.mem_fraction_static == 0.7


def test_a_flag_sglang_does_not_know_fails_here() -> None:
    """The oracle can fail: a misspelt flag is refused by SGLang's parser, not by us."""
    engine = EngineSpec(engine="sglang", extra_args=["--enable-return-routed-expertz"])
    with pytest.raises(FlagError, match="refuses the command"):
        parse_server_args(sglang_command(engine, MODEL)[3:])


@pytest.mark.parametrize("precision", [Precision.FP8, Precision.MXFP8, Precision.NVFP4])
def test_a_quantized_engine_serves_the_converted_checkpoint_with_its_format(
    precision: Precision, tmp_path: Path
) -> None:
    """SGLang's own ModelConfig check of --quantization against the checkpoint's quantization_config
    (what it runs at start): the flag the operator renders agrees with what convert-model writes."""
    from lockstep.models.tiny import materialize_builtin
    from lockstep.numerics.quant import Format, Scheme
    from lockstep.numerics.recipe import Recipe, convert_checkpoint

    served = convert_checkpoint(
        materialize_builtin("builtin:tiny", tmp_path / "src", seed=0),
        tmp_path / "served",
        Recipe(Scheme.of(Format(precision.value)), ("*.o_proj",)),
    )
    engine = EngineSpec(engine="sglang", gpus_per_engine=1, precision=precision)
    model = ModelSpec(checkpoint=str(served), family="tiny")
    cmd = sglang_command(engine, model)
    assert_parses_as_asked(cmd, engine, model)
    config = json.loads((served / "config.json").read_text())
    assert parse_server_args(cmd[3:]).quantization == checkpoint_quant_method(config)
