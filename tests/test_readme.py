"""The README's two commands are the ones CI runs."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_commands() -> None:
    readme = (REPO / "README.md").read_text()
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    install, test = block.strip().splitlines()
    ci = (REPO / ".ci" / "run").read_text()
    assert "pip install" in install and "pytest" in test
    assert install in ci
    assert f"{test} ||" in ci
