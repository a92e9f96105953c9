"""A BatchedEnv over a gymnasium vector env: one process per env, or all in this process.

Shared by every adapter whose simulator steps one env at a time (ManiSkill's CPU backend, any
gymnasium id, LIBERO). Uses gymnasium's SAME_STEP auto-reset, which hands back the final
observation of a finished episode in ``info["final_obs"]``.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv
from tensordict import TensorDict

from m2flow.envs.base import BatchedEnv, EnvSpec


class GymVectorEnv(BatchedEnv):
    """Steps ``len(env_fns)`` gymnasium envs together.

    Args:
        env_fns: picklable callables that each build one env (Box or Dict observations).
        processes: True: one subprocess per env (forkserver, so a live renderer in this
            process is never forked); False: all envs in this process.
        max_episode_steps: the time limit the envs enforce, reported in ``spec``.
        rebuild_options: reset options that rebuild the simulator (``reset(rebuild=True)``).
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]],
        *,
        processes: bool,
        max_episode_steps: Optional[int],
        rebuild_options: Optional[dict] = None,
    ):
        self.num_envs = len(env_fns)
        self.rebuild_options = rebuild_options
        self.steps_in_background = processes
        if processes:
            self.vec = AsyncVectorEnv(
                list(env_fns), context="forkserver", autoreset_mode=AutoresetMode.SAME_STEP
            )
        else:
            self.vec = SyncVectorEnv(list(env_fns), autoreset_mode=AutoresetMode.SAME_STEP)
        self.spec = _spec(self.vec, max_episode_steps)

    def reset(self, seed: Optional[Sequence[int]] = None, *, rebuild: bool = False) -> TensorDict:
        options = self.rebuild_options if rebuild else None
        obs, _ = self.vec.reset(seed=None if seed is None else [int(s) for s in seed],
                                options=options)
        return TensorDict({"obs": self._obs(obs)}, batch_size=[self.num_envs])

    def step(self, action: torch.Tensor) -> TensorDict:
        self.step_async(action)
        return self.step_wait()

    def step_async(self, action: torch.Tensor) -> None:
        act = self.clip_action(action.detach().float().cpu()).numpy()
        act = act.reshape(self.vec.action_space.shape)
        if isinstance(self.vec, AsyncVectorEnv):
            self.vec.step_async(act)
        else:
            self._pending_action = act

    def step_wait(self) -> TensorDict:
        if isinstance(self.vec, AsyncVectorEnv):
            result = self.vec.step_wait()
        else:
            act, self._pending_action = self._pending_action, None
            result = self.vec.step(act)
        obs, reward, terminated, truncated, info = result
        done = np.logical_or(terminated, truncated)
        success = _success(info, done, self.num_envs)
        final_obs = _final_obs(obs, info, done)
        return TensorDict(
            {
                "obs": self._obs(obs),
                "next": {
                    "obs": self._obs(final_obs),
                    "reward": torch.as_tensor(reward, dtype=torch.float32),
                    "terminated": torch.as_tensor(terminated, dtype=torch.bool),
                    "truncated": torch.as_tensor(truncated, dtype=torch.bool),
                    "done": torch.as_tensor(done, dtype=torch.bool),
                    "success": torch.as_tensor(success, dtype=torch.bool),
                },
            },
            batch_size=[self.num_envs],
        )

    def close(self) -> None:
        self.vec.close()

    def _obs(self, obs) -> TensorDict:
        if isinstance(obs, dict):
            return TensorDict(
                {k: torch.as_tensor(np.asarray(v)) for k, v in obs.items()},
                batch_size=[self.num_envs],
            )
        return TensorDict(
            {"state": torch.as_tensor(np.asarray(obs), dtype=torch.float32)},
            batch_size=[self.num_envs],
        )


def _spec(vec, max_episode_steps: Optional[int]) -> EnvSpec:
    space = vec.single_observation_space
    if isinstance(space, gym.spaces.Dict):
        shapes = {k: tuple(s.shape) for k, s in space.spaces.items()}
    else:
        shapes = {"state": tuple(space.shape)}
    act = vec.single_action_space
    return EnvSpec(
        obs_shapes=shapes,
        action_dim=int(np.prod(act.shape)),
        action_low=tuple(float(x) for x in np.broadcast_to(act.low, act.shape)),
        action_high=tuple(float(x) for x in np.broadcast_to(act.high, act.shape)),
        max_episode_steps=max_episode_steps,
    )


def _final_obs(obs, info: dict, done: np.ndarray):
    """Observations the step ended in: ``obs`` with finished envs' rows replaced by final_obs."""
    if not done.any():
        return obs
    finals = info["final_obs"]
    if isinstance(obs, dict):
        out = {k: np.array(v, copy=True) for k, v in obs.items()}
        for i in np.flatnonzero(done):
            for k in out:
                out[k][i] = finals[i][k]
        return out
    out = np.array(obs, copy=True)
    for i in np.flatnonzero(done):
        out[i] = finals[i]
    return out


def _success(info: dict, done: np.ndarray, n: int) -> np.ndarray:
    """The task's success flag after the step (a finished env's comes from its final info)."""
    success = np.zeros(n, dtype=bool)
    if "success" in info:
        success = np.asarray(info["success"], dtype=bool) & info.get("_success", True)
    if done.any() and "final_info" in info:
        final = info["final_info"]
        if "success" in final:
            mask = np.asarray(final.get("_success", done), dtype=bool)
            success = np.where(done, np.asarray(final["success"], dtype=bool) & mask, success)
        else:
            success = np.where(done, False, success)
    return success
