"""Evaluation rounds of an env worker: each env's first episode, with its video frames.

A round resets env i from ``seeds[i]`` (on task ``tasks[i]``) and steps every env for the
round's steps; ``EvalRecorder`` keeps each env's first episode (return, length, success_once
and success_at_end, and, where asked, its frames from the reset on). The env worker runs the
round through its pipeline and hands the recorder each step (``EnvWorker.eval_round``);
``EvalRound`` is what the evaluation protocol asks of one env worker for one round.

>>> import torch
>>> from tensordict import TensorDict
>>> from m2flow import keys
>>> rec = EvalRecorder([2], {"state": (3,)}, seeds=[7, 8])
>>> flag = torch.tensor([True, False])
>>> step = TensorDict({keys.REWARD: torch.ones(2), keys.DONE: flag, keys.SUCCESS: flag},
...                   batch_size=[2])
>>> rec.record(0, step)
>>> [(e.seed, e.length, e.success_once, e.success_at_end) for e in rec.finish()]
[(7, 1, True, True), (8, 1, False, False)]

Env 1 never ended: a failure by both counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.workers.episodes import (
    EvalEpisode,
    RunningEpisodes,
    env_steps,
    lost,
    success_at_end,
)
from m2flow.embodied.workers.stages import offsets


@dataclass
class EvalRound:
    """One env worker's part of an evaluation round (``EnvWorker.eval_round``'s arguments)."""

    seeds: list[int]
    """Reset seed of each env (for LIBERO: the init state)."""
    tasks: Optional[list[int]] = None
    """Task of each env (multi-task envs); None: the env worker's own task rotation."""
    max_steps: Optional[int] = None
    """Env steps per episode; None: the env's time limit."""
    video: Optional[list[bool]] = None
    """Which envs keep their frames (needs an image observation)."""
    chunk: int = 1
    """Env steps per policy call (action chunks)."""


def image_key(obs_shapes: dict) -> Optional[str]:
    """The obs key videos are made of: 'rgb' if present, else the first (H, W, 3) key.

    >>> image_key({"state": (8,), "wrist_rgb": (64, 64, 3)})
    'wrist_rgb'
    """
    if keys.leaf(keys.RGB) in obs_shapes:
        return keys.leaf(keys.RGB)
    return next((k for k, s in obs_shapes.items() if len(s) == 3 and s[-1] == 3), None)


class EvalRecorder:
    """Records one evaluation round over env groups of ``sizes`` envs.

    Args:
        sizes: envs per env group, in the worker's env order.
        obs_shapes: the env's observation shapes (``EnvSpec.obs_shapes``), to find the image.
        seeds, tasks: each env's reset seed and task, kept in its ``EvalEpisode``.
        video: ``video[i]``: keep env i's frames until its first episode ends.

    An episode lost to a simulator restart comes back ``discarded``; the env's next episode
    is then not counted either.
    """

    def __init__(self, sizes: list[int], obs_shapes: dict, *, seeds: list[int],
                 tasks: Optional[list] = None, video: Optional[list[bool]] = None):
        n = sum(sizes)
        self.sizes = list(sizes)
        self.offsets = offsets(self.sizes)
        self.episodes = [EvalEpisode(seed=seeds[i], task=None if tasks is None else int(tasks[i]))
                         for i in range(n)]
        self.image_key = image_key(obs_shapes) if video and any(video) else None
        self.keep = torch.tensor([bool(video and video[i] and self.image_key) for i in range(n)])
        self.runs = [RunningEpisodes(m) for m in self.sizes]
        self.seen = torch.zeros(n, dtype=torch.bool)  # env's first episode has ended

    def start(self, obs: list[TensorDict]) -> None:
        """The reset: ``obs[g]`` is group g's first observation (its first frame)."""
        if self.image_key is None:
            return
        for g, o in enumerate(obs):
            self._frames(g, o, self.keep[self._slice(g)])

    def record(self, g: int, step: TensorDict) -> None:
        """Group g's step (the batch the learner would see, with ``keys.NEXT``)."""
        sl = self._slice(g)
        gone = lost(step)
        done = step[keys.DONE].cpu()
        first = done & ~self.seen[sl]
        runs = self.runs[g]
        ret = runs.ret + step[keys.REWARD].cpu()
        length = runs.len + env_steps(step)
        once = runs.success_once | step[keys.SUCCESS].cpu()
        at_end = success_at_end(step)
        if self.image_key is not None:
            live = self.keep[sl] & ~self.seen[sl] & ~gone
            if keys.FRAMES in step.keys(include_nested=True):  # a chunk: every step's frame
                self._chunk_frames(g, step, live)
            else:
                self._frames(g, step[keys.NEXT_OBS], live)
        for j in first.nonzero().flatten().tolist():
            ep = self.episodes[self.offsets[g] + j]
            ep.ret, ep.length = float(ret[j]), int(length[j])
            ep.success_once, ep.success_at_end = bool(once[j]), bool(at_end[j])
            ep.discarded = bool(gone[j])
        self.seen[sl] |= done
        runs.update(step)

    def finish(self) -> list[EvalEpisode]:
        """Each env's first episode; one still running counts as a failure (both figures)."""
        for g, runs in enumerate(self.runs):
            for j in (~self.seen[self._slice(g)]).nonzero().flatten().tolist():
                ep = self.episodes[self.offsets[g] + j]
                ep.ret, ep.length = float(runs.ret[j]), int(runs.len[j])
                ep.success_once = ep.success_at_end = False
        return self.episodes

    def _slice(self, g: int) -> slice:
        return slice(self.offsets[g], self.offsets[g] + self.sizes[g])

    def _frames(self, g: int, obs: TensorDict, live: torch.Tensor) -> None:
        for j in live.nonzero().flatten().tolist():
            self.episodes[self.offsets[g] + j].frames.append(obs[self.image_key][j].cpu().numpy())

    def _chunk_frames(self, g: int, step: TensorDict, live: torch.Tensor) -> None:
        frames, steps = step[keys.FRAMES], step[keys.NUM_STEPS]  # (n, K, H, W, 3), (n,)
        for j in live.nonzero().flatten().tolist():
            for k in range(int(steps[j])):
                self.episodes[self.offsets[g] + j].frames.append(frames[j, k].cpu().numpy())
