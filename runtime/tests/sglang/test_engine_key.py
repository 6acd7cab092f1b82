"""The job's key reaches SGLang without a command line, and SGLang's start-up log never shows it.

Checked against the pinned SGLang's own code: the operator's engine pod command for an SGLang example
goes through the real start step (lockstep.observability.sglang_start.prepare), SGLang's own parser
reads the key from the config file it writes, and, in a fresh process with the environment the pod
has, SGLang's own `configure_logger` loads the logging configuration and the line SGLang logs at start
(`server_args=...`, read from its engine.py here so a change there is noticed) is emitted: the key is
not in it. The same line without the start step (the key passed as `--api-key`, as the operator
rendered it before) shows the key: the check can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lockstep.api import load_manifest
from lockstep.api.rolloutpool import RolloutPoolSpec
from lockstep.observability.sglang_start import prepare
from lockstep_operator.resources.children import child_manifests
from lockstep_operator.resources.common import Owner
from lockstep_operator.resources.engines import engine_manifest
from lockstep_operator.resources.sglang import SGLANG_START
from sglang_oracle import parse_server_args, require_pinned_sglang, source

pytestmark = pytest.mark.heavy  # a python subprocess importing SGLang

KEY = "k3y-that-must-never-be-logged-0123456789abcdefghij"
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "h100.yaml"

# What SGLang does at start, in its own calls: parse (prepare_server_args), configure logging
# (configure_logger, which reads SGLANG_LOGGING_CONFIG_PATH) and log the resolved arguments the way
# engine.py's _server_args_for_logging does (engine.py itself needs uvloop and CUDA to import).
_START = """
import json, logging, sys
from sglang.srt.server_args import prepare_server_args
from sglang.srt.utils.common import configure_logger
from sglang.srt.sampling.watermarking.core import redact_watermark_secrets
server_args = prepare_server_args(json.loads(sys.argv[1]))
configure_logger(server_args)
logger = logging.getLogger("sglang.srt.entrypoints.engine")
logger.info(f"server_args={redact_watermark_secrets(server_args.resolved_dict())}")
try:
    raise RuntimeError(f"a failure whose text holds {server_args.api_key}")
except RuntimeError:
    logger.exception("start-up failed")
"""


@pytest.fixture(autouse=True, scope="module")
def _pinned() -> None:
    require_pinned_sglang()


def _engine_command() -> list[str]:
    job = load_manifest(EXAMPLE)
    own = Owner(api_version="rl.lockstep.dev/v1alpha1", kind="RLJob", name="j", uid="u", namespace="ns")
    pool = next(
        m for m in child_manifests(own, job.spec, suspended=False, stopped="") if m["kind"] == "RolloutPool"
    )
    pod = engine_manifest(own, RolloutPoolSpec.model_validate(pool["spec"]), 0, gang_min=1, image="img")
    command: list[str] = pod["spec"]["containers"][0]["command"]
    assert command[: len(SGLANG_START)] == list(SGLANG_START), command
    return [a.replace("$(POD_IP)", "127.0.0.1") for a in command[len(SGLANG_START) :]]


def _start_log(argv: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _START, json.dumps(argv)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_sglang_still_logs_its_resolved_arguments_at_start() -> None:
    """The line the redaction is for is still in the pinned SGLang (if it goes, so can this test)."""
    text = source("srt/entrypoints/engine.py").read_text()
    assert 'logger.info(f"server_args={_server_args_for_logging(server_args)}")' in text
    assert "return redact_watermark_secrets(server_args.resolved_dict())" in text


def test_the_key_reaches_sglang_through_its_config_file(tmp_path: Path) -> None:
    command = _engine_command()
    assert "--api-key" not in command and KEY not in " ".join(command)
    full, env = prepare(command, KEY, tmp_path / "sglang")
    assert KEY not in " ".join(full)  # the command line (ps, /proc/<pid>/cmdline) never holds it
    assert (tmp_path / "sglang" / "args.yaml").stat().st_mode & 0o077 == 0
    parsed = parse_server_args(full[3:])
    assert parsed.api_key == KEY
    assert env["SGLANG_LOGGING_CONFIG_PATH"] == str(tmp_path / "sglang" / "logging.json")


def test_sglangs_start_up_log_never_shows_the_key(tmp_path: Path) -> None:
    command = _engine_command()
    full, env = prepare(command, KEY, tmp_path / "sglang")
    log = _start_log(full[3:], {**env, "LOCKSTEP_API_KEY": KEY})
    assert "server_args=" in log and "start-up failed" in log and "Traceback" in log, log[-2000:]
    assert KEY not in log
    assert "'api_key': '<redacted>'" in log
    # the way it was: the key as a flag, SGLang's default logging
    before = _start_log([*command[3:], "--api-key", KEY], {"LOCKSTEP_API_KEY": KEY})
    assert KEY in before


def test_the_start_step_refuses_a_second_key_or_config(tmp_path: Path) -> None:
    for extra in (["--api-key", "x"], ["--config", "/tmp/c.yaml"]):
        with pytest.raises(ValueError, match="already has --api-key or --config"):
            prepare(["python3", "-m", "sglang.launch_server", *extra], KEY, tmp_path)
