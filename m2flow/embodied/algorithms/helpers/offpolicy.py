"""The maths of soft actor-critic (SAC, and RLPD, which is SAC with demonstrations in every
batch), as pure functions over tensors: the critics' target, the actor's and the temperature's
losses, and the Polyak update of target networks. The forms are cleanRL's
``sac_continuous_action.py`` and ManiSkill's SAC baseline.

A step that **terminated** (the task ended: success, failure) does not bootstrap; a step that
was **truncated** (a time limit) does, from the final observation the env kept under
``"next"``: the episode was cut, not ended, so its value goes on.

>>> r, q1, q2, logp = (torch.tensor([1.0, 1.0]), torch.tensor([2.0, 2.0]),
...                    torch.tensor([3.0, 3.0]), torch.tensor([-1.0, -1.0]))
>>> soft_q_target(r, q1, q2, logp, terminated=torch.tensor([False, True]), alpha=0.5, gamma=0.9)
tensor([3.2500, 1.0000])
"""

from __future__ import annotations

from typing import Iterable

import torch


def soft_q_target(reward: torch.Tensor, next_q1: torch.Tensor, next_q2: torch.Tensor,
                  next_log_prob: torch.Tensor, *, terminated: torch.Tensor,
                  alpha: float | torch.Tensor, gamma: float) -> torch.Tensor:
    """The critics' regression target (B,): ``r + gamma * (1 - terminated) * (min(Q1', Q2')
    - alpha * log pi(a'|s'))``, with ``a' ~ pi(.|s')`` and Q' the target critics; a time-out
    (``truncated``, not ``terminated``) bootstraps like any other step."""
    soft_value = torch.minimum(next_q1, next_q2) - alpha * next_log_prob
    return reward + gamma * (~terminated.bool()).to(reward.dtype) * soft_value


def actor_loss(log_prob: torch.Tensor, q1: torch.Tensor, q2: torch.Tensor, *,
               alpha: float | torch.Tensor) -> torch.Tensor:
    """``mean(alpha * log pi(a|s) - min(Q1, Q2)(s, a))`` with ``a ~ pi(.|s)`` reparameterised
    (gradients reach the actor through ``a`` and ``log_prob``; the critics are not stepped
    by this loss).

    >>> actor_loss(torch.tensor([-1.0, 0.0]), torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0]),
    ...            alpha=0.5)
    tensor(-0.7500)
    """
    return (alpha * log_prob - torch.minimum(q1, q2)).mean()


def temperature_loss(log_alpha: torch.Tensor, log_prob: torch.Tensor, *,
                     target_entropy: float) -> torch.Tensor:
    """``mean(-alpha * (log pi(a|s) + target_entropy))`` with ``alpha = exp(log_alpha)``
    (cleanRL's and ManiSkill's form): minimising it raises alpha while the policy's entropy
    ``-log pi`` is below ``target_entropy`` (usually ``-action_dim``) and lowers it above.
    ``log_prob`` is a constant here.

    >>> temperature_loss(torch.tensor(0.0), torch.tensor([1.0, 3.0]), target_entropy=-1.0)
    tensor(-1.)
    """
    return (-log_alpha.exp() * (log_prob.detach() + target_entropy)).mean()


@torch.no_grad()
def polyak_update(target: Iterable[torch.Tensor], online: Iterable[torch.Tensor], *,
                  tau: float) -> None:
    """``target <- tau * online + (1 - tau) * target``, in place, tensor by tensor (the
    target critics trail the online ones; ``tau=1`` copies).

    >>> t, o = [torch.zeros(2)], [torch.ones(2)]
    >>> polyak_update(t, o, tau=0.25)
    >>> t[0]
    tensor([0.2500, 0.2500])
    """
    target, online = list(target), list(online)
    if len(target) != len(online):
        raise ValueError(f"polyak_update: {len(target)} target tensors, {len(online)} online.")
    torch._foreach_lerp_(target, online, tau)
