"""The README has exactly two set-up commands, and CI runs the test one verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_two_setup_commands_and_ci_runs_the_test_one() -> None:
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", setup, flags=re.S)
    assert len(commands) == 2, commands
    run_cmd, test_cmd = commands
    assert "modeserve" in run_cmd and "pytest" in test_cmd
    assert test_cmd in (ROOT / ".ci" / "run").read_text().splitlines()
