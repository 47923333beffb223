"""Build hooks of the documentation site (`mkdocs.yml`): the configuration reference,
written from the config models at every build, and ARCHITECTURE.md as a page of the site
(one file in the repository, shown in both places)."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files


def on_files(files: Files, config) -> Files:
    from rollwire.services.core.config.reference import markdown

    files.append(File.generated(config, "reference/configuration.md", content=markdown()))
    architecture = Path(config["config_file_path"]).parent / "ARCHITECTURE.md"
    files.append(File.generated(config, "architecture.md", content=architecture.read_text()))
    return files
