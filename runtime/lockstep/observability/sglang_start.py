"""The start of an SGLang engine pod: the job's key reaches SGLang in a file, and SGLang's logs never show it.

Why it exists: SGLang takes its API key as `--api-key KEY`, so the operator used to render
`--api-key $(LOCKSTEP_API_KEY)`: the kubelet expands it into the process's command line, and SGLang
logs its arguments at start (`server_args=...` at INFO, `api_key` included), so anyone allowed to read
the pod's log (`pods/log`) or the node's process list read the key. The pinned SGLang reads no
environment variable for it; it does read `--config FILE` (a YAML file of its flags, merged before
parsing: sglang/srt/server_args.py `prepare_server_args`, utils/server_args_config_parser.py), and a
logging configuration named by `SGLANG_LOGGING_CONFIG_PATH` (a JSON dictConfig that replaces its
default one in every SGLang process: utils/common.py `configure_logger`). Its resolved arguments are
logged whatever way the key arrived, so both are needed:

1. the key, read from the Secret-backed environment variable, is written to `args.yaml` (mode 0600,
   in a memory-backed directory) and SGLang gets `--config args.yaml`: no command line carries it;
2. `logging.json` keeps SGLang's own format and level and adds `RedactSecrets`, which replaces the
   key by `<redacted>` in every record (message, arguments, traceback) before any handler writes it.

Then this process becomes SGLang (exec): one process, SGLang's own signals and exit code.
Run: `python3 -m lockstep.observability.sglang_start [--dir DIR] -- python3 -m sglang.launch_server ...`
(the operator renders it for `engine: sglang`; runtime/tests/sglang/test_engine_key.py checks it against
the pinned SGLang's parser and logging).

Who calls it: the engine pod's container command (lockstep_operator.resources.sglang).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lockstep.api.auth import API_KEY_ENV

DEFAULT_DIR = "/dev/shm/lockstep-sglang"
"""Where the two files go: the engine pod's /dev/shm is a memory-backed volume (never on a disk)."""
LOGGING_ENV = "SGLANG_LOGGING_CONFIG_PATH"
"""SGLang's variable naming a JSON logging dictConfig."""
REDACTED = "<redacted>"


class RedactSecrets(logging.Filter):
    """Replaces the value of the environment variable `env` (the job's key) by `<redacted>` in every
    record it sees: the formatted message, and a traceback or stack text. A filter on a handler sees
    every record that reaches the handler."""

    def __init__(self, env: str = API_KEY_ENV) -> None:
        super().__init__()
        self.secret = os.environ.get(env, "")

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secret:
            return True
        message = record.getMessage()
        if self.secret in message:
            record.msg, record.args = message.replace(self.secret, REDACTED), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text and self.secret in record.exc_text:
            record.exc_text = record.exc_text.replace(self.secret, REDACTED)
        if record.stack_info and self.secret in record.stack_info:
            record.stack_info = record.stack_info.replace(self.secret, REDACTED)
        return True


def logging_config(level: str = "info", env: str = API_KEY_ENV) -> dict[str, Any]:
    """SGLang's default logging (its format, `level`, stderr) with RedactSecrets on the handler."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"redact": {"()": f"{__name__}.RedactSecrets", "env": env}},
        "formatters": {"sglang": {"format": "[%(asctime)s] %(message)s", "datefmt": "%Y-%m-%d %H:%M:%S"}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "sglang",
                "filters": ["redact"],
            }
        },
        "root": {"level": level.upper(), "handlers": ["stderr"]},
        "loggers": {name: {"level": "WARNING"} for name in ("httpx", "httpcore")},
    }


def _log_level(command: Sequence[str]) -> str:
    for i, arg in enumerate(command):
        if arg == "--log-level" and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith("--log-level="):
            return arg.split("=", 1)[1]
    return "info"


def prepare(command: Sequence[str], key: str, directory: Path) -> tuple[list[str], dict[str, str]]:
    """Write args.yaml (the key) and logging.json into `directory`; return SGLang's command with
    `--config args.yaml` and the environment additions. Pure but for the two files."""
    if any(a == "--api-key" or a.startswith("--api-key=") or a == "--config" for a in command):
        raise ValueError(
            "the SGLang command already has --api-key or --config: the key comes from "
            f"${API_KEY_ENV} through the config file this launcher writes (remove them from extraArgs)"
        )
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    args = directory / "args.yaml"
    fd = os.open(args, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"api-key: {json.dumps(key)}\n")  # a JSON string is a YAML string
    logs = directory / "logging.json"
    logs.write_text(json.dumps(logging_config(_log_level(command))))
    return [*command, "--config", str(args)], {LOGGING_ENV: str(logs)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m lockstep.observability.sglang_start", description=__doc__
    )
    parser.add_argument(
        "--dir", default=DEFAULT_DIR, help=f"where args.yaml and logging.json go ({DEFAULT_DIR})"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then SGLang's command")
    ns = parser.parse_args(argv)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    key = os.environ.get(API_KEY_ENV)
    if not command:
        parser.error("no SGLang command after --")
    if not key:
        print(f"error: ${API_KEY_ENV} is empty: the engine pod reads the job's key from it", file=sys.stderr)
        return 2
    try:
        full, env = prepare(command, key, Path(ns.dir))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.execvpe(full[0], full, {**os.environ, **env})
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
