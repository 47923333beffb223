"""Run and service configuration: pydantic models, YAML loading and overrides.

Every model is importable from here; `models` holds the run config and the
sections every service shares, `runtime`, `servers` and `orchestrator` the rest.
Imports neither torch nor grpc, so every tool can read a config cheaply.
"""

from rollwire.services.core.config.loader import (
    ConfigError,
    load_config,
    parse_assignment,
    write_resolved_config,
)
from rollwire.services.core.config.models import (
    EndpointsConfig,
    RLSection,
    RunConfig,
    RunSection,
    WarmupConfig,
)
from rollwire.services.core.config.orchestrator import (
    CHAIN_SUM_SMALL,
    AgentConfig,
    DatasetConfig,
    EnvDataset,
    FileDataset,
    MixtureDataset,
    MixturePart,
    OrchestratorConfig,
    ReasoningGymDataset,
    SingleDataset,
    share_key,
)
from rollwire.services.core.config.runtime import (
    Z85_ALPHABET,
    AuthConfig,
    ClientConfig,
    CurveClientConfig,
    CurveServerConfig,
    MiB,
    ServerConfig,
    StrictModel,
    TelemetryConfig,
    TLSConfig,
    check_curve_key,
)
from rollwire.services.core.config.servers import (
    BufferConfig,
    EnvServerConfig,
    LossConfig,
    RewardServerConfig,
    RolloutServerConfig,
    TrainerConfig,
)

__all__ = [
    "CHAIN_SUM_SMALL",
    "Z85_ALPHABET",
    "AgentConfig",
    "AuthConfig",
    "BufferConfig",
    "ClientConfig",
    "ConfigError",
    "CurveClientConfig",
    "CurveServerConfig",
    "DatasetConfig",
    "EndpointsConfig",
    "EnvDataset",
    "EnvServerConfig",
    "FileDataset",
    "LossConfig",
    "MiB",
    "MixtureDataset",
    "MixturePart",
    "OrchestratorConfig",
    "RLSection",
    "ReasoningGymDataset",
    "RewardServerConfig",
    "RolloutServerConfig",
    "RunConfig",
    "RunSection",
    "ServerConfig",
    "SingleDataset",
    "StrictModel",
    "TLSConfig",
    "TelemetryConfig",
    "TrainerConfig",
    "WarmupConfig",
    "check_curve_key",
    "load_config",
    "parse_assignment",
    "share_key",
    "write_resolved_config",
]
