"""A run's configuration: the dataclasses and their YAML form (`schema`), the checks that refuse bad values with the
key and the fix (`checks`), and reading YAML and `--section.key=value` overrides (`loading`). The package
re-exports `schema`'s names, so that `parallel_attention.training.config.load_config` (the module of 0.2) keeps
working."""

from .schema import (BlendEntry, CheckpointConfig, ConfigError, DataConfig, LoggingConfig, ModelConfig,  # noqa: F401
                     OptimizerConfig, ParallelConfig, PretrainConfig, ScheduleConfig, TrainingConfig, config_from_dict,
                     load_config, save_config)
