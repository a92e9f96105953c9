"""``toy/Reach-v0``: move a point in the plane to a goal; success within 0.1 of it."""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from m2flow.envs.config import EnvConfig
from m2flow.envs.vector import GymVectorEnv


@dataclass
class ToyReachConfig(EnvConfig):
    """The settings of ``toy/Reach-v0``: m2flow's common ones and the task's own. m2flow
    stores it as schema ``env/toy_reach_v0_schema``, which ``configs/env/toy_reach.yaml``
    extends."""

    step_size: float = 0.1
    """How far an action of norm 1 moves the point."""


class Reach(gym.Env):
    observation_space = gym.spaces.Box(-2.0, 2.0, (4,), np.float32)  # position, goal
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def __init__(self, max_steps: int = 20, step_size: float = 0.1):
        self.max_steps, self.step_size = max_steps, step_size
        self.pos = self.goal = np.zeros(2, np.float32)
        self.t = 0

    def _obs(self):
        return np.concatenate([self.pos, self.goal]).astype(np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        self.goal = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.pos = np.clip(self.pos + self.step_size * np.asarray(action, np.float32), -2, 2)
        self.t += 1
        dist = float(np.linalg.norm(self.pos - self.goal))
        success = dist < 0.1
        return self._obs(), -dist, success, self.t >= self.max_steps, {"success": success}


class ToyReachEnv(GymVectorEnv):
    """The batched env m2flow builds: ``cfg.num_envs`` copies, in this process."""

    config_class = ToyReachConfig

    def __init__(self, cfg: ToyReachConfig, device: str = "cpu"):
        steps = cfg.max_episode_steps or 20
        super().__init__([lambda: Reach(steps, cfg.step_size)] * cfg.num_envs, processes=False,
                         max_episode_steps=steps)
