"""Shell tasks: rows from user data, the built-in suite, and every kind's test script in a real sandbox.

The suite's promise is that each test script tells the right command from doing nothing and from a
plausible wrong one; it is checked by running them (setup, command, test) in the local sandbox.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lockstep.models.tiny import chat_tokenizer
from lockstep.sandbox import LocalSandboxProvider, SandboxConfig
from lockstep.sandbox.landlock import abi_version
from lockstep.tasks import load_task
from lockstep.tasks.data import read_rows
from lockstep.tasks.shell import SANDBOX_KEY, reward
from lockstep.tasks.shell.suite import KINDS, rows, task
from lockstep.types import Sample

ROOT = Path(__file__).resolve().parents[3]
SUITE_FILE = ROOT / "examples" / "data" / "shell-tasks.jsonl"

WRONG = {  # a plausible wrong command per kind (the model confusing two kinds)
    "touch": "mkdir {a}",
    "mkdir": "touch {a}",
    "write": "echo {n}{n} > {a}",
    "remove": "touch {a}",
    "copy": "mv {a} {b}",
    "move": "cp {a} {b}",
}


def test_rows_load_as_shell_tasks_with_their_scripts(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(
        json.dumps({"instruction": "make file ab", "test": "[ -f ab ]", "solution": "touch ab", "tag": 1})
        + "\n"
        + json.dumps({"instruction": "remove ab", "setup": "touch ab", "test": "[ ! -e ab ]"})
        + "\n"
    )
    task = load_task(str(path))
    first, second = task.item(0), task.item(1)
    assert first.messages == ({"role": "user", "content": "make file ab"},)
    assert first.metadata["test"] == "[ -f ab ]" and first.metadata["setup"] is None
    assert first.metadata["tag"] == 1
    assert first.metadata["reference_reply"]["tool_calls"][0]["function"] == {
        "name": "sh",
        "arguments": '{"cmd":"touch ab"}',
    }
    assert second.metadata["setup"] == "touch ab" and "reference_reply" not in second.metadata


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"instruction": "x"}, '"test"'),
        ({"instruction": "", "test": "true"}, '"instruction"'),
        ({"instruction": "x", "test": "true", "setup": 3}, '"setup"'),
    ],
)
def test_a_bad_task_row_names_the_field(tmp_path: Path, row: dict[str, object], field: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:1: .*{field}"):
        read_rows(str(path))


def test_the_shipped_suite_file_is_the_builtin_suite() -> None:
    """examples/data/shell-tasks.jsonl is `builtin:shell`'s first rows as user data (regenerate with
    `python -m lockstep.tasks.shell.suite > examples/data/shell-tasks.jsonl`)."""
    shipped = [json.loads(line) for line in SUITE_FILE.read_text().splitlines()]
    assert shipped == list(rows(0, "train", len(shipped)))
    assert len(shipped) >= 64


def test_builtin_items_are_deterministic_disjoint_and_in_the_tiny_vocabulary() -> None:
    suite = load_task("builtin:shell", seed=3)
    assert suite.item(7) == load_task("builtin:shell", seed=3).item(7)
    train = {suite.item(i).messages[0]["content"] for i in range(400)}
    evals = {suite.item(i, "eval").messages[0]["content"] for i in range(suite.eval_size)}
    assert not train & evals
    tok = chat_tokenizer()
    for i in range(50):
        item = suite.item(i)
        tok.encode(item.messages[0]["content"])  # raises on a character the tiny model cannot read
        tok.reply_pair(item.messages, item.metadata["reference_reply"], item.metadata["reference_tools"])


def test_reward_is_the_test_scripts_verdict() -> None:
    ok = Sample(0, 0, [1], metadata={SANDBOX_KEY: {"test_exit": 0}})
    failed = Sample(0, 1, [1], metadata={SANDBOX_KEY: {"test_exit": 1}})
    never = Sample(0, 2, [1], metadata={})
    assert (reward(ok, ""), reward(failed, ""), reward(never, "")) == (1.0, 0.0, 0.0)


@pytest.mark.skipif(abi_version() < 1, reason="no Landlock in this kernel (Linux >= 5.13)")
@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_each_kind_passes_its_solution_and_fails_nothing_and_a_wrong_command(
    tmp_path: Path, kind: str
) -> None:
    a, b, n = "ab", "cd", "42"
    instruction, setup, test, solution = KINDS[kind](a, b, n)
    provider = LocalSandboxProvider(SandboxConfig(image="unused", command_timeout_s=5), tmp_path)
    verdicts = {}
    for label, command in (("solution", solution), ("nothing", None), ("wrong", WRONG[kind])):
        async with provider.claim(f"{kind}-{label}") as box:
            if setup:
                assert (await box.exec(setup)).exit_code == 0
            if command:
                await box.exec(command.format(a=a, b=b, n=n))
            verdicts[label] = (await box.exec(test)).exit_code
    assert verdicts["solution"] == 0, (instruction, verdicts)
    assert verdicts["nothing"] != 0 and verdicts["wrong"] != 0, (instruction, verdicts)


def test_every_kind_appears_in_the_suite() -> None:
    assert {task(0, "train", i)[0] for i in range(200)} == set(KINDS)
