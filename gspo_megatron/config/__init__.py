"""Typed run configuration: schema, loading with overrides, validation."""

from gspo_megatron.config.load import apply_overrides, load_config, save_config
from gspo_megatron.config.schema import GSPOConfig
from gspo_megatron.config.validate import ConfigError, validate_config

__all__ = ["ConfigError", "GSPOConfig", "apply_overrides", "load_config", "save_config",
           "validate_config"]
