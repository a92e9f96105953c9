"""The env registry: names -> adapters, imported lazily.

Three ways in, all ending in the same table:

- ``@register_env("MySim/Task-v1")`` on a class in code that is imported;
- ``register_env("MySim/Task-v1", "my_pkg.envs:TaskEnv")``: a string, imported on first use;
- an entry point in group ``m2flow.envs`` of an installed package (``name = "module:Class"``),
  so another package adds a simulator without touching m2flow.

A name ending in ``/*`` is a family: ``ManiSkill/*`` serves ``ManiSkill/PushCube-v1``, and the
adapter gets the full name. The class is called as ``cls(cfg, device=...)``, ``cfg`` an
instance of its ``config_class`` (``env_config(name, **fields)`` makes one); its schema is
stored as ``env/<schema_name>`` (:func:`register_schemas`). A family's class lists
``EXAMPLE_IDS`` so tests that sweep the registry know which concrete ids to build.
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
    base_config=EnvConfig,
    builtins={
        "ManiSkill/*": "m2flow.envs.maniskill:ManiSkillEnv",
        "gym/*": "m2flow.envs.gymnasium_env:GymnasiumEnv",
        "LIBERO/*": "m2flow.envs.libero:LiberoEnv",
        "mjlab/*": "m2flow.envs.mjlab_env:MjlabEnv",
        "MetaWorld/*": "m2flow.envs.metaworld:MetaWorldEnv",
    },
)

register_env, registered_envs, env_class, env_config = ENVS.functions()
__all__ = ["ENVS", "env_class", "env_config", "make_env", "register_env", "register_schemas",
           "registered_envs", "suggest"]


def make_env(cfg: EnvConfig, device: str = "cpu") -> BatchedEnv:
    """Builds the env ``cfg.name`` describes, on ``device`` when its simulator can use one;
    EnvError when ``cfg`` is not the adapter's settings class or its simulator is not
    installed."""
    cls = ENVS.require(cfg.name)
    ENVS.check_settings(cfg, cls, "env")
    return cls(cfg, device=device)


def register_schemas(cs) -> None:
    """Stores each adapter's ``config_class`` in ConfigStore ``cs`` as ``env/<schema>``
    (``ManiSkill/*`` -> ``env/maniskill_schema``), so an env group file that starts with
    ``defaults: [maniskill_schema, _self_]`` is checked against it. Imports every adapter
    module (not its simulator)."""
    ENVS.store_schemas(cs, "env")
