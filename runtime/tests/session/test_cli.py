"""`lockstep sessions`: the subcommand is discovered and refuses an unknown family with the choices."""

from __future__ import annotations

import pytest
from lockstep.cli import build_parser, main


def test_sessions_subcommand_parses_replicas() -> None:
    args = build_parser().parse_args(
        ["sessions", "--engine", "http://127.0.0.1:1", "--engine", "http://127.0.0.1:2", "--family", "qwen3"]
    )
    assert args.engine == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert args.host == "127.0.0.1"


def test_unknown_family_exits_2_and_lists_the_families(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sessions", "--engine", "http://127.0.0.1:1", "--family", "llama"]) == 2
    out = capsys.readouterr().out
    assert "glm47, glm5, qwen3, tiny" in out


def test_dp_size_below_one_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sessions", "--engine", "http://127.0.0.1:1", "--family", "tiny", "--dp-size", "0"]) == 2
    assert "--dp-size 0" in capsys.readouterr().out
