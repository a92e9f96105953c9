"""A BatchedEnv over single gymnasium envs: in simulator processes, or all in this process.

Shared by every adapter whose simulator steps one env at a time (ManiSkill's CPU backend, any
gymnasium id, LIBERO). Envs auto-reset in the step their episode ends (see
:mod:`m2flow.envs.procs`); with processes, a simulator process that dies or hangs is
restarted and its episode reported as ``("next", "discarded")``.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.envs.base import BatchedEnv, EnvSpec
from m2flow.envs.procs import LocalSlots, ProcessSlots, StepResult


class GymVectorEnv(BatchedEnv):
    """Steps ``len(env_fns)`` gymnasium envs together.

    Args:
        env_fns: picklable callables that each build one env (Box or Dict observations).
        processes: True: the envs in subprocesses (``envs_per_process`` each), a process
            restarted if it dies or hangs; False: all envs in this process.
        max_episode_steps: the time limit the envs enforce, reported in ``spec``.
        rebuild_options: reset options that rebuild the simulator (``reset(rebuild=True)``).
        timeout: with processes, seconds a step or reset may take before the process counts
            as hung and is replaced.
        tasks: language descriptions of the tasks the envs can switch between at reset
            (``reset(task=...)`` passes ``options["task"]``); empty for a one-task env.
        shared_memory: with processes, which observation arrays come back through shared
            memory: 'auto', 'on' or 'off' (see :class:`ProcessSlots`).
        max_restarts: with processes, restarts of one process in a row before the run ends
            (see :class:`ProcessSlots`).
        name: the env's name in errors (e.g. 'ManiSkill/PushCube-v1').
        envs_per_process: with processes, envs each process steps (see :class:`ProcessSlots`).
    """

    skips_frames = True  # passed to each env's step_without_frames where it has one (procs)

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]],
        *,
        processes: bool,
        max_episode_steps: Optional[int],
        rebuild_options: Optional[dict] = None,
        timeout: float = 300.0,
        tasks: Sequence[str] = (),
        shared_memory: str = "auto",
        max_restarts: int = 3,
        name: str = "",
        envs_per_process: int = 1,
    ):
        self.num_envs = len(env_fns)
        self.rebuild_options = rebuild_options
        self.steps_in_background = processes
        self.name, self.tasks = name, tuple(tasks)
        self.slots = (ProcessSlots(env_fns, timeout=timeout, shared_memory=shared_memory,
                                   max_restarts=max_restarts, label=self._label,
                                   envs_per_process=envs_per_process)
                      if processes else LocalSlots(env_fns))
        self.spec = _spec(self.slots, max_episode_steps, tuple(tasks))

    def _label(self, i: int, options: Optional[dict]) -> str:
        """'ManiSkill/PushCube-v1, env 3' (and ", task '<its language>'" where it has tasks)."""
        label = f"{self.name or 'env'}, env {i}"
        task = (options or {}).get("task")
        if task is not None and 0 <= task < len(self.tasks):
            label += f", task {self.tasks[task]!r}"
        return label

    @property
    def restarts(self) -> int:
        """Simulator processes replaced so far (each one discarded its envs' episodes)."""
        return self.slots.restarts

    def reset(self, seed: Optional[Sequence[int]] = None, *, rebuild: bool = False,
              task: Optional[Sequence[int]] = None) -> TensorDict:
        self._send_resets(seed, rebuild, task)
        return self._first_obs()

    def reset_async(self, seed: Optional[Sequence[int]] = None, *, rebuild: bool = False,
                    task: Optional[Sequence[int]] = None) -> None:
        if type(self).reset is not GymVectorEnv.reset:  # a subclass's own reset runs whole
            kw = {} if task is None else {"task": task}
            return super().reset_async(seed, rebuild=rebuild, **kw)
        self._send_resets(seed, rebuild, task)

    def reset_wait(self) -> TensorDict:
        if getattr(self, "_pending_reset", None) is not None:
            return super().reset_wait()
        return self._first_obs()

    def _send_resets(self, seed, rebuild: bool, task) -> None:
        seeds = [None] * self.num_envs if seed is None else [int(s) for s in seed]
        options = []
        for i in range(self.num_envs):
            o = dict(self.rebuild_options) if rebuild and self.rebuild_options else {}
            if task is not None:
                o["task"] = int(task[i])
            options.append(o or None)
        self.slots.reset_async(seeds, options)

    def _first_obs(self) -> TensorDict:
        return TensorDict({keys.OBS: self._obs(self.slots.reset_wait())},
                          batch_size=[self.num_envs])

    def step(self, action: torch.Tensor) -> TensorDict:
        self.step_async(action)
        return self.step_wait()

    def step_async(self, action: torch.Tensor, *, frames: bool = True) -> None:
        act = self.clip_action(action.detach().float().cpu()).numpy()
        self.slots.step_async(act.reshape((self.num_envs, *self.slots.action_space.shape)),
                              frames)

    def step_wait(self) -> TensorDict:
        results: list[StepResult] = self.slots.step_wait()
        col = lambda name, dtype: torch.tensor([getattr(r, name) for r in results], dtype=dtype)  # noqa: E731
        terminated, truncated = col("terminated", torch.bool), col("truncated", torch.bool)
        return TensorDict(
            {
                keys.OBS: self._obs([r.obs for r in results]),
                keys.NEXT_OBS: self._obs([r.final_obs for r in results]),
                keys.REWARD: col("reward", torch.float32),
                keys.TERMINATED: terminated,
                keys.TRUNCATED: truncated,
                keys.DONE: terminated | truncated,
                keys.SUCCESS: col("success", torch.bool),
                keys.DISCARDED: col("discarded", torch.bool),
            },
            batch_size=[self.num_envs],
        )

    def close(self) -> None:
        self.slots.close()

    def _obs(self, obs: list) -> TensorDict:
        if isinstance(obs[0], dict):
            return TensorDict(
                {k: torch.as_tensor(np.stack([o[k] for o in obs])) for k in obs[0]},
                batch_size=[self.num_envs],
            )
        return TensorDict(
            {keys.leaf(keys.STATE): torch.as_tensor(np.stack(obs), dtype=torch.float32)},
            batch_size=[self.num_envs],
        )


def _spec(slots, max_episode_steps: Optional[int], tasks: tuple = ()) -> EnvSpec:
    space = slots.observation_space
    if isinstance(space, gym.spaces.Dict):
        shapes = {k: tuple(s.shape) for k, s in space.spaces.items()}
    else:
        shapes = {keys.leaf(keys.STATE): tuple(space.shape)}
    act = slots.action_space
    return EnvSpec(
        obs_shapes=shapes,
        action_dim=int(np.prod(act.shape)),
        action_low=tuple(float(x) for x in np.broadcast_to(act.low, act.shape).ravel()),
        action_high=tuple(float(x) for x in np.broadcast_to(act.high, act.shape).ravel()),
        max_episode_steps=max_episode_steps,
        tasks=tasks,
    )
