"""Simulators behind one batched interface, found through a registry.

``import m2flow.envs`` imports no simulator: adapters are imported when first made.
"""

from m2flow.envs.base import BatchedEnv, EnvError, EnvSpec
from m2flow.envs.config import EnvConfig
from m2flow.envs.registry import env_class, env_config, make_env, register_env, registered_envs

__all__ = [
    "BatchedEnv",
    "EnvConfig",
    "EnvError",
    "EnvSpec",
    "env_class",
    "env_config",
    "make_env",
    "register_env",
    "registered_envs",
]
