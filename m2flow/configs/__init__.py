"""Hydra configs: entry configs per benchmark, composed from groups env/ policy/ algorithm/
cluster/ runner/, checked against the dataclass schema in :mod:`m2flow.configs.schema`."""

from m2flow.configs.loader import (
    ConfigError,
    load_config,
    load_run_config,
    load_train_config,
)

__all__ = ["ConfigError", "load_config", "load_run_config", "load_train_config"]
