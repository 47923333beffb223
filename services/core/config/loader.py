"""Builds a RunConfig from defaults, a YAML file, environment variables and
`--set` assignments, in that order of precedence (later wins).

Environment variables: `ROLLWIRE__SECTION__FIELD=value` sets `section.field`
(double underscores separate levels; names are case-insensitive). Values in
both overrides are parsed as YAML scalars or flow collections, so `1e-4`,
`true`, `null` and `[a, b]` mean what they look like.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rollwire.services.core.config.errors import describe
from rollwire.services.core.config.models import RunConfig
from rollwire.services.core.config.trainer import move_flat_keys, moved_keys
from rollwire.services.core.files import write_atomically

ENV_PREFIX = "ROLLWIRE__"
RESOLVED_NAME = "resolved_config.yaml"


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names every bad key by path."""


def parse_assignment(text: str) -> tuple[list[str], Any]:
    """Parses `a.b.c=value` into (["a", "b", "c"], value)."""
    key, sep, raw = text.partition("=")
    keys = [part.strip() for part in key.split(".")]
    if not sep or not all(keys):
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    return keys, _parse_value(raw, origin=f"override {text!r}")


def _parse_value(raw: str, origin: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"{origin}: value is not valid YAML: {error}") from None


def env_assignments(environ: Mapping[str, str]) -> list[tuple[list[str], Any, str]]:
    """Every `ROLLWIRE__A__B=value` variable as (["a", "b"], value, variable name)."""
    found = []
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        keys = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        if not all(keys):
            raise ConfigError(f"environment variable {name}: empty key between '__'")
        found.append((keys, _parse_value(environ[name], origin=name), name))
    return found


def _strip_masked_secrets(data: Any) -> None:
    """Default secrets dump as a mask; put None back so the mask is never taken for a token."""
    if isinstance(data, dict):
        for key, value in data.items():
            if value == "**********":
                data[key] = None
            else:
                _strip_masked_secrets(value)


def _set_path(data: dict[str, Any], keys: list[str], value: Any, origin: str) -> None:
    node = data
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:  # an optional section that is off: setting a key turns it on
            child = node[key] = {}
        if not isinstance(child, dict):
            where = ".".join(keys[: depth + 1])
            raise ConfigError(f"{origin}: {where} holds a value, not a section")
        node = child
    if keys[-1] == "type" and node.get("type") not in (None, value):
        node.clear()  # switching a pluggable part: the old kind's settings do not apply
    node[keys[-1]] = value


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Deep-merges `update` into `base`; a section that changes its `type` replaces the old one."""
    for key, value in update.items():
        current = base.get(key)
        same_kind = (
            isinstance(current, dict)
            and isinstance(value, dict)
            and value.get("type", current.get("type")) == current.get("type")
        )
        base[key] = _merge(current, value) if same_kind else value
    return base


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> RunConfig:
    """Loads and validates a run configuration.

    Args:
        path: YAML file; defaults only when None.
        overrides: `a.b=c` assignments, applied last.
        environ: environment to read `ROLLWIRE__` variables from (os.environ by default).

    Raises:
        ConfigError: naming the file and each offending key by its dotted path.
    """
    # Start from the defaults so that overriding one key of a section keeps the
    # section's other defaults (e.g. the evaluation dataset's own seed and size).
    data = RunConfig().model_dump(mode="json", exclude_none=False)
    _strip_masked_secrets(data)
    default_eval = copy.deepcopy(data["orchestrator"]["eval_dataset"])
    if path is not None:
        read = _read_yaml(Path(path))
        if isinstance(read.get("trainer"), dict):  # a flat section of earlier releases
            try:
                read["trainer"] = move_flat_keys(read["trainer"])
            except ValueError as error:
                raise ConfigError(f"invalid configuration ({path}): {error}") from None
        _merge(data, read)
    sources = [str(path) if path is not None else "defaults"]
    env = os.environ if environ is None else environ
    for keys, value, name in env_assignments(env):
        _set_path(data, moved_keys(keys), value, origin=f"environment variable {name}")
        sources.append(name)
    for text in overrides:
        keys, value = parse_assignment(text)
        _set_path(data, moved_keys(keys), value, origin=f"override {text!r}")
        sources.append(f"--set {text}")
    orchestrator = data.get("orchestrator")
    if (
        isinstance(orchestrator, dict)
        and isinstance(orchestrator.get("dataset"), dict)
        and orchestrator["dataset"].get("type") == "env"
        and orchestrator.get("eval_dataset") == default_eval
    ):
        # Training on an environment with the default (reasoning-gym) evaluation left in
        # place: let the model evaluate on held-out seeds of that environment instead.
        del orchestrator["eval_dataset"]
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe(error, RunConfig, ", ".join(sources))) from None


def write_resolved_config(config: RunConfig, run_dir: str | Path) -> Path:
    """Writes the config in effect to `run_dir/resolved_config.yaml`; secrets are masked."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / RESOLVED_NAME
    write_atomically(target, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return target
