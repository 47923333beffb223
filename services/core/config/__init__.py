"""Run and service configuration: pydantic models, YAML loading and overrides.

Every model is importable from here; `models` holds the run config and the
sections every service shares, `runtime`, `servers` and `orchestrator` the rest.
Imports neither torch nor grpc, so every tool can read a config cheaply.
"""

from rollwire.services.core.config import models
from rollwire.services.core.config.loader import (
    ConfigError,
    load_config,
    parse_assignment,
    write_resolved_config,
)
from rollwire.services.core.config.models import *  # noqa: F403 - the names of models.__all__

__all__ = [
    *models.__all__,
    "ConfigError",
    "load_config",
    "parse_assignment",
    "write_resolved_config",
]
