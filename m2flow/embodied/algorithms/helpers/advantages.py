"""Advantage estimation: pure functions on (num_envs, T) tensors (PPO's GAE) and on episode
returns grouped by initial state (GRPO).

GRPO: envs come in groups of ``group_size`` that reset to the same initial state (LIBERO
init-state id, ManiSkill seed). Each episode's advantage is its return against its group,
``(R - mean(group)) / (std(group) + eps)`` (:func:`m2flow.runs.rl.group_advantages`, shared with
reasoning), and every action of the episode carries it. A group
whose episodes all succeeded or all failed says nothing about which actions were better; groups
whose success rate lies outside ``[low, high]`` are dropped (by default: keep a group unless
all its episodes share one outcome).
"""

from __future__ import annotations

import torch


def gae(
    reward: torch.Tensor,
    value: torch.Tensor,
    next_value: torch.Tensor,
    terminated: torch.Tensor,
    done: torch.Tensor,
    *,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation with auto-reset trajectories.

    Every argument is (N, T). ``next_value`` is the critic at the observation step t ended in
    (the final observation when the episode ended there), so a truncated step bootstraps from
    it while a terminated step does not; ``done`` cuts the recursion at episode ends.

    Returns ``(advantage, return)``, both (N, T), with ``return = advantage + value``.

    >>> z = torch.zeros(1, 2)
    >>> adv, ret = gae(torch.ones(1, 2), z, z, z.bool(), z.bool(), gamma=0.5, gae_lambda=1.0)
    >>> adv
    tensor([[1.5000, 1.0000]])
    """
    not_terminated = 1.0 - terminated.float()
    not_done = 1.0 - done.float()
    advantage = torch.zeros_like(reward)
    running = torch.zeros_like(reward[:, 0])
    for t in reversed(range(reward.shape[1])):
        delta = reward[:, t] + gamma * next_value[:, t] * not_terminated[:, t] - value[:, t]
        running = delta + gamma * gae_lambda * not_done[:, t] * running
        advantage[:, t] = running
    return advantage, advantage + value


def keep_groups(success: torch.Tensor, group_size: int, low: float = 0.0,
                high: float = 1.0) -> torch.Tensor:
    """Per-episode mask: True where the group's success rate satisfies ``low < rate < high``;
    the defaults drop all-failure (rate 0) and all-success (rate 1) groups.

    >>> keep_groups(torch.tensor([1, 1, 0, 0, 0, 1, 1, 1]).bool(), group_size=2)
    tensor([False, False, False, False,  True,  True, False, False])
    """
    rate = _grouped(success.float(), group_size).mean(dim=1)
    keep = (rate > low) & (rate < high)
    return keep.repeat_interleave(group_size)


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1 or x.numel() % group_size:
        raise ValueError(
            f"{x.numel()} episodes do not split into groups of algorithm.group_size="
            f"{group_size}; make env.num_envs (times env workers) a multiple of it."
        )
    return x.reshape(-1, group_size)


def first_episodes(reward: torch.Tensor, done: torch.Tensor,
                   success: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each env's first episode in an (N, T) trajectory: (return (N,), success (N,), the mask
    (N, T) of its steps). An episode still running at T counts with what it has so far.

    >>> d = torch.tensor([[False, True, False], [False, False, False]])
    >>> ret, ok, steps = first_episodes(torch.ones(2, 3), d, d)
    >>> ret.tolist(), ok.tolist(), steps.tolist()
    ([2.0, 3.0], [True, False], [[True, True, False], [True, True, True]])
    """
    ended_before = (torch.cumsum(done.long(), dim=1) - done.long()) > 0
    steps = ~ended_before
    return (reward * steps).sum(1), (success & steps).any(1), steps
