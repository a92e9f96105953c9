"""Episode bookkeeping of an env worker: running sums per env, and the episodes that ended.

``RunningEpisodes`` follows the current episode of each env of one env group, step by step;
it hands back the episodes that ended as ``EpisodeStats`` (training, ``env/`` metrics). An
evaluation keeps one ``EvalEpisode`` per env (see :mod:`m2flow.embodied.workers.env_eval`).

An episode's success is counted twice, as ManiSkill's evaluation and RLinf count it:
``success_once``, the task predicate held at some step, and ``success_at_end``, it held at
the episode's last step (with ``env.ignore_terminations`` a policy can reach the goal and
push past it).

>>> import torch
>>> from tensordict import TensorDict
>>> from m2flow import keys
>>> runs = RunningEpisodes(2)
>>> def step(done, success):
...     return TensorDict({keys.REWARD: torch.ones(2), keys.SUCCESS: torch.tensor(success),
...                        keys.DONE: torch.tensor(done)}, batch_size=[2])
>>> runs.update(step([False, False], [True, False])).returns
[]
>>> ended = runs.update(step([True, False], [False, False]))  # env 0 left the goal, then ended
>>> ended.returns, ended.success_once, ended.success_at_end
([2.0], [True], [False])
>>> runs.len.tolist()  # env 0 starts over, env 1 runs on
[0, 2]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from tensordict import TensorDict

from m2flow import keys


@dataclass
class EpisodeStats:
    """Episodes that ended during a call (per-env running sums live in ``RunningEpisodes``)."""

    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    success_once: list[bool] = field(default_factory=list)
    """Per episode: success at any of its steps."""
    success_at_end: list[bool] = field(default_factory=list)
    """Per episode: success at its last step."""
    discarded: int = 0
    """Episodes lost to a simulator process that died or hung (not in the lists above)."""
    seconds: float = 0.0
    """Wall seconds of the collection call, timed where it ran (the env worker); merged
    across env workers, which collect side by side, as the slowest one's."""

    def extend(self, other: "EpisodeStats") -> None:
        self.returns += other.returns
        self.lengths += other.lengths
        self.success_once += other.success_once
        self.success_at_end += other.success_at_end
        self.discarded += other.discarded
        self.seconds = max(self.seconds, other.seconds)

    def summary(self) -> dict[str, float]:
        n = len(self.returns)
        lost = {"env/discarded_episodes": float(self.discarded)}
        if n == 0:
            return {"env/episodes": 0.0, **lost}
        return {
            **lost,
            "env/episodes": float(n),
            "env/return": sum(self.returns) / n,
            "env/episode_len": sum(self.lengths) / n,
            "env/success_once": sum(self.success_once) / n,
            "env/success_at_end": sum(self.success_at_end) / n,
        }


@dataclass
class EvalEpisode:
    """One evaluation episode: where it started and how it went."""

    seed: int
    task: Optional[int] = None
    ret: float = 0.0
    length: int = 0
    success_once: bool = False
    success_at_end: bool = False
    discarded: bool = False
    frames: list = field(default_factory=list)
    """(H, W, 3) uint8 images from the reset to the end of the episode, if asked for."""


def env_steps(step: TensorDict):
    """Env steps each env took in ``step``: ``keys.NUM_STEPS`` (action chunks) or 1."""
    n = step.get(keys.NUM_STEPS, None)
    return 1 if n is None else n.cpu()


def success_at_end(step: TensorDict) -> torch.Tensor:
    """Success at the last env step of each env's transition that belongs to its episode (on
    the host): ``keys.SUCCESS_AT_END`` (action chunks), or a one-step transition's
    ``keys.SUCCESS``."""
    flag = step.get(keys.SUCCESS_AT_END, None)
    return (step[keys.SUCCESS] if flag is None else flag).cpu()


def lost(step: TensorDict) -> torch.Tensor:
    """Envs whose episode a simulator restart lost in ``step`` (all False if none can)."""
    done = step[keys.DONE]
    return step.get(keys.DISCARDED, torch.zeros_like(done)).cpu()


class RunningEpisodes:
    """Running return/length/success_once of each env's current episode (one env group); its
    success_at_end is that of the step it ends in."""

    def __init__(self, n: int):
        self.ret = torch.zeros(n)
        self.len = torch.zeros(n, dtype=torch.long)
        self.success_once = torch.zeros(n, dtype=torch.bool)

    def update(self, step: TensorDict, only: torch.Tensor | None = None) -> EpisodeStats:
        """Adds ``step`` (a batch with the ``keys.NEXT`` results); returns the episodes that
        ended in it (or, with ``only``, those of the envs it marks) and starts them over."""
        self.ret += step[keys.REWARD].cpu()
        self.len += env_steps(step)
        self.success_once |= step[keys.SUCCESS].cpu()
        done = step[keys.DONE].cpu()
        gone = lost(step)
        report = (done if only is None else only) & ~gone
        out = EpisodeStats(
            returns=self.ret[report].tolist(),
            lengths=self.len[report].tolist(),
            success_once=self.success_once[report].tolist(),
            success_at_end=success_at_end(step)[report].tolist(),
            discarded=int(gone.sum()),
        )
        self.ret[done], self.len[done], self.success_once[done] = 0.0, 0, False
        return out
