"""Action chunks: a policy call that returns K actions per env is K env steps.

``ChunkedEnv`` wraps any ``BatchedEnv``. An action (n, A) passes through unchanged. An action
chunk (n, K, A) runs K steps; the result is one transition per chunk, as the learner sees it:

- ``("next", "reward")``: the sum of the rewards up to and including the step the episode
  ended in (the rest of the chunk belongs to the next episode);
- ``done`` / ``terminated`` / ``truncated`` / ``success`` / ``discarded``: whether it happened
  in the chunk (before or at the episode's end);
- ``("next", "success_at_end")``: the success flag of the episode's last step in the chunk
  (the step it ended in, else the chunk's last): ManiSkill's ``success_at_end`` once the
  episode has ended;
- ``("next", "obs")``: the observation the episode's part of the chunk ended in (the final one
  if the episode ended), ``"obs"``: the one after the last step (to act on next);
- the per-step values are kept for the learner: ``("next", "step_reward")`` and
  ``("next", "step_done")`` (n, K), and ``("next", "num_steps")`` (n,), the env steps the
  episode's part took.

After an episode ends inside a chunk, the env (auto-reset) runs the chunk's remaining actions
in its next episode; that episode's bookkeeping starts from there.

Only the last step's observation and the one an episode ended in are read, so an env that
``skips_frames`` is told that a chunk's other steps need no images (``frames=False``): with
K=8 it renders one step in 8 (``frames_key`` renders every step).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.envs.base import BatchedEnv


class ChunkedEnv(BatchedEnv):
    frames_key: Optional[str] = None
    """Set to an image obs key to also get every step's frame of a chunk, ``("next",
    "frames")`` (n, K, H, W, 3): evaluation videos at the env's own frame rate."""

    def __init__(self, env: BatchedEnv):
        self.env = env
        self.num_envs, self.spec, self.device = env.num_envs, env.spec, env.device
        self.steps_in_background = env.steps_in_background
        self.episode_clocks = env.episode_clocks
        self._chunk: Optional[torch.Tensor] = None

    def __getattr__(self, name: str):
        """Anything else (``restarts``, ``slots``, ...) is the wrapped env's."""
        if name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)

    def reset(self, seed: Optional[Sequence[int]] = None, *, rebuild: bool = False, **kw):
        return self.env.reset(seed, rebuild=rebuild, **kw)

    def reset_async(self, seed: Optional[Sequence[int]] = None, *, rebuild: bool = False,
                    **kw) -> None:
        self.env.reset_async(seed, rebuild=rebuild, **kw)

    def reset_wait(self) -> TensorDict:
        return self.env.reset_wait()

    def start_episodes_at(self, steps: torch.Tensor) -> None:
        self.env.start_episodes_at(steps)

    def step(self, action: torch.Tensor) -> TensorDict:
        self.step_async(action)
        return self.step_wait()

    def step_async(self, action: torch.Tensor) -> None:
        if action.ndim == 2:
            self._chunk = None
            self.env.step_async(action)
        else:  # the first step starts now, the others in step_wait
            self._chunk = action
            self._step_async(action, 0)

    def _step_async(self, chunk: torch.Tensor, j: int) -> None:
        """Starts step ``j`` of ``chunk``; its frames are wanted only if it is the last."""
        if self.env.skips_frames and self.frames_key is None and j + 1 < chunk.shape[1]:
            self.env.step_async(chunk[:, j], frames=False)
        else:
            self.env.step_async(chunk[:, j])

    def step_wait(self) -> TensorDict:
        return step_wait_all([self])[0]

    def close(self) -> None:
        self.env.close()


def step_wait_all(envs: Sequence[ChunkedEnv]) -> list[TensorDict]:
    """``step_wait`` of several envs whose chunks were started (``step_async``), their K steps
    in lockstep: each env's step j+1 starts as soon as its step j is back, while the others'
    step j still runs. Waiting for one env's whole chunk before the next env's would leave
    the other envs' simulators (processes of their own) idle for K-1 steps: the groups of an
    env worker's stage would simulate one after another instead of side by side.
    """
    chunks = [e._chunk for e in envs]
    for e in envs:
        e._chunk = None
    outs: list[list[TensorDict]] = [[] for _ in envs]
    steps = max((c.shape[1] for c in chunks if c is not None), default=1)
    for j in range(steps):
        for e, c, out in zip(envs, chunks, outs):
            if j < (1 if c is None else c.shape[1]):
                out.append(e.env.step_wait())
                if c is not None and j + 1 < c.shape[1]:
                    e._step_async(c, j + 1)
    return [out[0] if c is None else combine(out, e.frames_key)
            for e, c, out in zip(envs, chunks, outs)]


def combine(outs: list[TensorDict], frames_key: Optional[str] = None) -> TensorDict:
    """K single-step results -> one chunk transition (see the module docstring)."""
    n = outs[0].batch_size[0]
    done = torch.stack([o[keys.DONE] for o in outs], dim=1)  # (n, K)
    reward = torch.stack([o[keys.REWARD] for o in outs], dim=1)
    # steps that belong to the episode the chunk started in: up to its first done
    ended_before = torch.cumsum(done.long(), dim=1) - done.long() > 0
    own = ~ended_before
    # every tensor made here lives where the env's results do (a GPU simulator's: CUDA)
    no_end = torch.full((n,), len(outs) - 1, device=done.device)
    last = torch.where(done.any(1), done.float().argmax(1), no_end)  # (n,) step of next obs
    rows = torch.arange(n, device=done.device)
    out = {
        keys.OBS: outs[-1][keys.OBS],
        keys.REWARD: (reward * own).sum(1),
        keys.NEXT_OBS: torch.stack([o[keys.NEXT_OBS] for o in outs], dim=1)[rows, last],
        keys.STEP_REWARD: reward,
        keys.STEP_DONE: done,
        keys.NUM_STEPS: own.sum(1),
    }
    if frames_key is not None:
        out[keys.FRAMES] = torch.stack([o[(*keys.NEXT_OBS, frames_key)] for o in outs], dim=1)
    present = outs[0].keys(include_nested=True)
    for flag in keys.FLAGS:
        if flag in present:
            v = torch.stack([o[flag] for o in outs], dim=1)
            out[flag] = (v & own).any(1)
            if flag == keys.SUCCESS:
                out[keys.SUCCESS_AT_END] = v[rows, last]
    return TensorDict(out, batch_size=[n])
