"""Hydra configs: entry configs per benchmark, composed from groups env/ policy/ algorithm/
cluster/ runner/, checked against dataclass schemas that the layers owning them store with
:func:`m2flow.configs.schema.store`. Imports no workload."""

from m2flow.configs.loader import ConfigError, load_config, to_object

__all__ = ["ConfigError", "load_config", "to_object"]
