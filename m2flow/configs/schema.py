"""Registers the root schema in Hydra's ConfigStore, so every YAML and override is type-checked.

Defaults live only in the dataclasses; YAML files set what differs from them.
"""

from hydra.core.config_store import ConfigStore

from m2flow.embodied.config import TrainConfig
from m2flow.reasoning.config import ReasoningConfig

SCHEMAS = {"train_schema": TrainConfig, "reasoning_schema": ReasoningConfig}


def register() -> None:
    cs = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        cs.store(name=name, node=node)
