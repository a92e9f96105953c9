"""A deterministic fake env and policy for engine tests (never to show a feature working).

``test/Counter``: env i's observation is ``[seed_i, t, last action]``; episodes last 5 steps.
``test/CounterProc``: the same env, one subprocess per env (steps in the background, like
ManiSkill's CPU backend).
``test/Rendezvous``: a process env whose reset waits until ``parties`` resets (of any
env object) have started, so it fails unless resets of separate envs run at the same time;
with ``steps``, each step after an episode's first likewise (its settings:
:class:`RendezvousConfig`).
``test/echo``: action = 0.1 * (seed + t) of the observation; deterministic, no sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from m2flow.envs import EnvSpec, register_env
from m2flow.envs.base import BatchedEnv
from m2flow.envs.config import ProcessEnvConfig
from m2flow.envs.vector import GymVectorEnv
from m2flow.policies import register_policy
from m2flow.policies.base import Policy

EPISODE = 5
SPEC = EnvSpec({"state": (3,)}, 1, (-100.0,), (100.0,), EPISODE)


class CounterEnv(BatchedEnv):
    def __init__(self, cfg, device: str = "cpu"):
        self.num_envs, self.spec = cfg.num_envs, SPEC
        self.seed = torch.zeros(self.num_envs)
        self.t = torch.zeros(self.num_envs)
        self.last = torch.zeros(self.num_envs)

    def _obs(self):
        return TensorDict({"state": torch.stack([self.seed, self.t, self.last], -1)},
                          batch_size=[self.num_envs])

    def reset(self, seed: Sequence[int] | None = None, *, rebuild: bool = False):
        self.seed = torch.tensor([float(s % 1000) for s in seed]) if seed is not None else self.seed
        self.t.zero_()
        self.last.zero_()
        return TensorDict({"obs": self._obs()}, batch_size=[self.num_envs])

    def step(self, action):
        self.t += 1
        self.last = action[:, 0].float().clone()
        done = self.t >= EPISODE
        final = self._obs()
        self.t[done] = 0
        return TensorDict(
            {"obs": self._obs(),
             "next": {"obs": final, "reward": self.last.clone(), "terminated": done.clone(),
                      "truncated": torch.zeros_like(done), "done": done.clone(),
                      "success": done.clone()}},
            batch_size=[self.num_envs],
        )


class CounterGym(gym.Env):
    """One env of ``test/Counter`` as a gymnasium env (runs in its own process)."""

    observation_space = gym.spaces.Box(-1e6, 1e6, (3,), np.float32)
    action_space = gym.spaces.Box(-100.0, 100.0, (1,), np.float32)

    def __init__(self):
        self.seed_value, self.t, self.last = 0.0, 0, 0.0

    def _obs(self):
        return np.array([self.seed_value, self.t, self.last], dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.seed_value = float(seed % 1000)
        self.t, self.last = 0, 0.0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        self.last = float(action[0])
        done = self.t >= EPISODE
        return self._obs(), self.last, done, False, {"success": done}


class CounterProcEnv(GymVectorEnv):
    def __init__(self, cfg, device: str = "cpu"):
        super().__init__([CounterGym] * cfg.num_envs, processes=True, max_episode_steps=EPISODE)


class RendezvousGym(CounterGym):
    """Its reset marks ``folder`` and waits (up to 30 s) for ``parties`` marks; with
    ``steps``, so does each step t after the first of an episode (marks ``step<t>-<pid>``)."""

    def __init__(self, folder: str, parties: int, steps: bool = False):
        super().__init__()
        self.folder, self.parties, self.steps = folder, parties, steps

    def _meet(self, mark: str, prefix: str, what: str) -> None:
        import os
        import time
        open(os.path.join(self.folder, mark), "w").close()
        deadline = time.monotonic() + 30
        count = lambda: sum(f.startswith(prefix) for f in os.listdir(self.folder))  # noqa: E731
        while count() < self.parties:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} alone: {count()} of {self.parties} started")
            time.sleep(0.02)

    def reset(self, *, seed=None, options=None):
        import os
        self._meet(f"r{os.getpid()}-{seed}", "r", "reset")
        return super().reset(seed=seed, options=options)

    def step(self, action):
        import os
        if self.steps and self.t >= 1:
            self._meet(f"step{self.t}-{os.getpid()}", f"step{self.t}-", f"step {self.t}")
        return super().step(action)


@dataclass
class RendezvousConfig(ProcessEnvConfig):
    """The settings of ``test/Rendezvous``: the process env's and where and how many meet."""

    folder: str = ""
    """Where the resets (and steps) leave their marks."""
    parties: int = 1
    """Marks a reset waits for."""
    steps: bool = False
    """Steps after an episode's first wait too."""


class RendezvousProcEnv(GymVectorEnv):
    config_class = RendezvousConfig

    def __init__(self, cfg: RendezvousConfig, device: str = "cpu"):
        from functools import partial
        fn = partial(RendezvousGym, cfg.folder, cfg.parties, cfg.steps)
        super().__init__([fn] * cfg.num_envs, processes=True, max_episode_steps=EPISODE)


class EchoPolicy(Policy):
    def __init__(self, cfg, env_spec):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.1))

    def _mean(self, obs):
        s = obs["state"]
        return (self.scale * (s[..., 0] + s[..., 1]))[..., None]

    def act(self, batch, deterministic: bool = False):
        mean = self._mean(batch["obs"])
        zeros = torch.zeros(batch.batch_size)
        return TensorDict({"action": mean, "log_prob": zeros, "value": zeros},
                          batch_size=batch.batch_size)

    def evaluate_actions(self, batch):
        lp = -((batch["action"] - self._mean(batch["obs"])) ** 2).sum(-1)
        return TensorDict({"log_prob": lp, "entropy": torch.zeros_like(lp),
                           "value": torch.zeros_like(lp)}, batch_size=batch.batch_size)

    def value(self, obs):
        return torch.zeros(obs.batch_size)


def register() -> None:
    register_env("test/Counter", CounterEnv, override=True)
    register_env("test/CounterProc", CounterProcEnv, override=True)
    register_env("test/Rendezvous", RendezvousProcEnv, override=True)
    register_policy("test/echo", EchoPolicy, override=True)
