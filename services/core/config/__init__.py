"""Run and service configuration: pydantic models, YAML loading and overrides.

Imports neither torch nor grpc, so every tool can read a config cheaply.
"""

from rollwire.services.core.config.loader import (
    ConfigError,
    load_config,
    parse_assignment,
    write_resolved_config,
)
from rollwire.services.core.config.models import (
    AgentConfig,
    AuthConfig,
    BufferConfig,
    ClientConfig,
    EnvDataset,
    EnvServerConfig,
    OrchestratorConfig,
    RewardServerConfig,
    RLSection,
    RolloutServerConfig,
    RunConfig,
    RunSection,
    ServerConfig,
    TelemetryConfig,
    TLSConfig,
    TrainerConfig,
)

__all__ = [
    "AgentConfig",
    "AuthConfig",
    "BufferConfig",
    "ClientConfig",
    "ConfigError",
    "EnvDataset",
    "EnvServerConfig",
    "OrchestratorConfig",
    "RLSection",
    "RewardServerConfig",
    "RolloutServerConfig",
    "RunConfig",
    "RunSection",
    "ServerConfig",
    "TLSConfig",
    "TelemetryConfig",
    "TrainerConfig",
    "load_config",
    "parse_assignment",
    "write_resolved_config",
]
