"""Advantage estimation: pure functions on (num_envs, T) tensors."""

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
