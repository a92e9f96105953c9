"""The env registry: names -> adapters, imported lazily.

Three ways in, all ending in the same table:

- ``@register_env("MySim/Task-v1")`` on a class in code that is imported;
- ``register_env("MySim/Task-v1", "my_pkg.envs:TaskEnv")``: a string, imported on first use;
- an entry point in group ``m2flow.envs`` of an installed package (``name = "module:Class"``),
  so another package adds a simulator without touching m2flow.

A name ending in ``/*`` is a family: ``ManiSkill/*`` serves ``ManiSkill/PushCube-v1``, and the
adapter gets the full name. The class is called as ``cls(cfg, device=...)``. A family's class
lists ``EXAMPLE_IDS`` so tests that sweep the registry know which concrete ids to build.
"""

from __future__ import annotations

from m2flow.envs.base import BatchedEnv, EnvError
from m2flow.envs.config import EnvConfig
from m2flow.registry import Registry, suggest

ENTRY_POINT_GROUP = "m2flow.envs"

ENVS = Registry(
    "env",
    ENTRY_POINT_GROUP,
    EnvError,
    {
        "ManiSkill/*": "m2flow.envs.maniskill:ManiSkillEnv",
        "gym/*": "m2flow.envs.gymnasium_env:GymnasiumEnv",
        "LIBERO/*": "m2flow.envs.libero:LiberoEnv",
        "mjlab/*": "m2flow.envs.mjlab_env:MjlabEnv",
    },
)

register_env = ENVS.register
registered_envs = ENVS.names
env_class = ENVS.load
__all__ = ["ENVS", "env_class", "make_env", "register_env", "registered_envs", "suggest"]


def make_env(cfg: EnvConfig, device: str = "cpu") -> BatchedEnv:
    """Builds the env ``cfg.name`` describes, on ``device`` when its simulator can use one."""
    return env_class(cfg.name)(cfg, device=device)
