"""Typed run configuration: one module per section, recipes, YAML and dotted overrides.

The rest of the package imports the config from here: `RunConfig`, each section's class and the
user-error types.
"""

from rlloom.config.algorithm import AlgorithmConfig
from rlloom.config.checks import ConfigError, UserError
from rlloom.config.cluster import ClusterConfig
from rlloom.config.critic import CriticConfig
from rlloom.config.data import DataConfig
from rlloom.config.loading import load_config, to_dict, to_yaml
from rlloom.config.logging import LoggingConfig
from rlloom.config.model import ModelConfig
from rlloom.config.parallel import ParallelConfig
from rlloom.config.reward import RewardConfig
from rlloom.config.rollout import RolloutConfig
from rlloom.config.run import RunConfig
from rlloom.config.sync import SyncConfig
from rlloom.config.teacher import TeacherConfig
from rlloom.config.train import TrainEngineConfig
from rlloom.config.trainer import TrainerConfig

__all__ = [
    "AlgorithmConfig",
    "ClusterConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SyncConfig",
    "TeacherConfig",
    "TrainEngineConfig",
    "TrainerConfig",
    "UserError",
    "load_config",
    "to_dict",
    "to_yaml",
]
