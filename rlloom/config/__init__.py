"""Typed run configuration: dataclasses, recipes, YAML and dotted overrides."""

from rlloom.config.components import (
    AlgorithmConfig,
    ClusterConfig,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrainEngineConfig,
    TrainerConfig,
    UserError,
)
from rlloom.config.loading import load_config, to_dict, to_yaml

__all__ = [
    "AlgorithmConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainEngineConfig",
    "TrainerConfig",
    "UserError",
    "load_config",
    "to_dict",
    "to_yaml",
]
