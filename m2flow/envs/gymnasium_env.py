"""Any gymnasium env id with a flat Box observation, as ``gym/<id>`` (e.g. ``gym/Pendulum-v1``).

Task: whatever the gymnasium env defines (``env.make_args``: its constructor's arguments).
Observations: ``("obs", "state")`` (D,) float32. Actions: the env's Box action space,
flattened. Success: the env's ``info["success"]`` if it reports one, else never.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Dict

import gymnasium as gym

from m2flow.envs.base import EnvError
from m2flow.envs.config import EnvConfig
from m2flow.registry import suggest
from m2flow.envs.vector import GymVectorEnv


@dataclass
class GymEnvConfig(EnvConfig):
    """``gym/<id>``: the common settings and the env's own constructor arguments."""

    make_args: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of ``gym.make(<id>, ...)``, e.g. Pendulum's ``g``."""


def _make_one(env_id: str, max_episode_steps, make_args: dict) -> gym.Env:
    return gym.make(env_id, max_episode_steps=max_episode_steps, **make_args)


class GymnasiumEnv(GymVectorEnv):
    """Adapter for ``gym/<id>``; envs run in this process."""

    EXAMPLE_IDS = ("gym/Pendulum-v1",)  # the registry sweep's picks
    config_class = GymEnvConfig

    @staticmethod
    def check_config(cfg: GymEnvConfig) -> None:
        """Raises EnvError for an unknown env id or an option the adapter cannot honour;
        builds no env."""
        env_id = cfg.name.split("/", 1)[1]
        if env_id not in gym.registry:
            raise EnvError(
                f"env.name={cfg.name!r}: gymnasium has no env {env_id!r}."
                f"{suggest(env_id, list(gym.registry))}"
            )
        if cfg.obs_mode != "state":
            raise EnvError(
                f"env.obs_mode={cfg.obs_mode!r}: the gymnasium adapter only passes 'state' "
                "observations; set env.obs_mode=state."
            )
        if cfg.ignore_terminations:
            raise EnvError(
                "env.ignore_terminations=true: a generic gymnasium env cannot be stepped past "
                "its termination; set it to false for gym/* envs."
            )

    def __init__(self, cfg: GymEnvConfig, device: str = "cpu"):
        env_id = cfg.name.split("/", 1)[1]
        self.check_config(cfg)
        make = functools.partial(_make_one, env_id, cfg.max_episode_steps, dict(cfg.make_args))
        probe = make()
        if not isinstance(probe.observation_space, gym.spaces.Box) or not isinstance(
            probe.action_space, gym.spaces.Box
        ):
            probe.close()
            raise EnvError(
                f"env.name={cfg.name!r}: the gymnasium adapter needs Box observation and action "
                f"spaces, got {probe.observation_space} and {probe.action_space}."
            )
        limit = probe.spec.max_episode_steps if probe.spec else None
        probe.close()
        super().__init__([make] * cfg.num_envs, processes=False, max_episode_steps=limit)
