"""The one batched env interface every simulator adapter implements.

Auto-reset semantics: ``step`` steps all envs; an env whose episode ends in that step
(terminated or truncated) is reset at once. Its final observation is returned under
``("next", "obs")`` and the first observation of its new episode under the root ``"obs"``,
so the caller always acts on ``out["obs"]`` and learns from ``out["next"]``. See
:mod:`m2flow.keys` for every key.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from tensordict import TensorDict

from m2flow.envs.config import EnvConfig
from m2flow.registry import Requires


class EnvError(ValueError):
    """Bad env input: an unknown name, an obs mode the simulator can't render, missing assets."""


@dataclass(frozen=True)
class EnvSpec:
    """What a policy needs to know about an env to be built for it."""

    obs_shapes: dict[str, tuple[int, ...]]
    """Per obs key (e.g. 'state', 'rgb'), the shape of one env's entry."""
    action_dim: int
    action_low: tuple[float, ...]
    action_high: tuple[float, ...]
    max_episode_steps: Optional[int]
    tasks: tuple[str, ...] = ()
    """Language instruction of each task the env can run (``("obs", "task")`` indexes it);
    empty for a one-task env. Envs with tasks take ``reset(..., task=[...])``."""
    task_groups: tuple[str, ...] = ()
    """A group label per task of ``tasks`` (Meta-World's difficulty: 'easy', ...), by which
    the evaluation report also averages, as published tables do; empty: no groups."""
    task_group_order: tuple[str, ...] = ()
    """The report's order of the groups (Meta-World: easy, medium, hard, very_hard, as the
    published tables read); empty, or a label not in it: the order the tasks name them."""


class BatchedEnv(ABC):
    """``num_envs`` environments stepped together, talking in TensorDicts of batch [num_envs].

    >>> from m2flow.envs import env_config, make_env
    >>> env = make_env(env_config("gym/Pendulum-v1", num_envs=2))
    >>> env.reset(seed=[0, 1])["obs", "state"].shape
    torch.Size([2, 3])
    >>> out = env.step(torch.zeros(2, 1))
    >>> sorted(out["next"].keys())
    ['discarded', 'done', 'obs', 'reward', 'success', 'terminated', 'truncated']
    """

    config_class: type = EnvConfig
    """Its settings: a dataclass extending :class:`EnvConfig`, the schema of its env group
    files (``m2flow.envs.config``); ``cls(cfg, device=...)`` gets one of these."""
    requires: Optional[Requires] = None
    """The simulator packages it imports when built (``m2flow.registry.Requires``), checked
    at start-up; None: none beyond m2flow's own."""
    num_envs: int
    spec: EnvSpec
    device: torch.device = torch.device("cpu")
    steps_in_background: bool = False
    """True when ``step_async`` returns while the simulator runs elsewhere (processes), so the
    caller can do other work (and start other envs) until ``step_wait``."""
    skips_frames: bool = False
    """True when ``step_async(action, frames=False)`` is understood: nobody reads the step's
    images (an action chunk's inner step), so the simulator may leave them unrendered
    (``ChunkedEnv`` asks it of every step but a chunk's last)."""
    episode_clocks: bool = False
    """True when ``start_episodes_at`` can set how far each env is into its episode
    (``runner.stagger_episodes`` needs it)."""

    @abstractmethod
    def reset(self, seed: Optional[Sequence[int]] = None, *, rebuild: bool = False) -> TensorDict:
        """Resets every env (env i with ``seed[i]`` if given); returns ``{"obs": ...}``.

        ``rebuild=True`` also rebuilds simulator state that a reset keeps (e.g. a physics
        scene), so the episode depends on the seed alone; slower, used for evaluation. Envs
        whose ``spec.tasks`` is not empty also take ``task=[...]``: env i switches to task
        ``task[i]`` (and keeps it through its auto-resets).
        """

    @abstractmethod
    def step(self, action: torch.Tensor) -> TensorDict:
        """Steps with ``action`` (num_envs, action_dim), clipped to the action bounds.

        Returns ``"obs"`` (to act on next) and ``"next"`` with obs, reward, terminated,
        truncated, done, success, and (envs whose simulators run in processes) discarded:
        the process died or hung in this step and was restarted; ``"obs"`` is then the first
        obs of a fresh episode, and the step and the episode it ended are not data.
        """

    def start_episodes_at(self, steps: torch.Tensor) -> None:
        """Sets env i's step count within its current episode to ``steps[i]`` (in [0, time
        limit)), so that episode times out after ``max_episode_steps - steps[i]`` more steps.
        Only for envs with ``episode_clocks``."""
        raise NotImplementedError(f"{type(self).__name__} cannot set its episodes' step counts")

    def reset_async(self, seed: Optional[Sequence[int]] = None, *, rebuild: bool = False,
                    **kw) -> None:
        """Starts ``reset`` and returns at once where the simulators run elsewhere
        (processes); ``reset_wait`` returns its result. Lets several envs reset at the same
        time (an env worker's groups). Default: the reset runs in ``reset_wait``."""
        self._pending_reset = (seed, rebuild, kw)

    def reset_wait(self) -> TensorDict:
        """The result of the reset started by ``reset_async``."""
        (seed, rebuild, kw), self._pending_reset = self._pending_reset, None
        return self.reset(seed, rebuild=rebuild, **kw)

    def step_async(self, action: torch.Tensor) -> None:
        """Starts a step and returns at once where the simulator runs elsewhere (processes);
        ``step_wait`` returns its result. Lets several envs simulate at the same time.
        Default: the step runs in ``step_wait``."""
        self._pending_action = action

    def step_wait(self) -> TensorDict:
        """The result of the step started by ``step_async``."""
        action, self._pending_action = self._pending_action, None
        return self.step(action)

    def close(self) -> None:
        """Frees the simulator (processes, renderer)."""

    def clip_action(self, action: torch.Tensor) -> torch.Tensor:
        low = torch.as_tensor(self.spec.action_low, dtype=action.dtype, device=action.device)
        high = torch.as_tensor(self.spec.action_high, dtype=action.dtype, device=action.device)
        return torch.clamp(action, low, high)
