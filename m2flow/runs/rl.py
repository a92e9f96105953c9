"""The RL maths both workloads share: group-relative advantages and PPO's clipped surrogate.

Embodied GRPO groups the episodes of envs reset to one initial state; reasoning GRPO groups the
completions of one prompt. Both score a sample against its group with the same rule, and both
train with the same clipped policy objective (embodied: a mean over samples; reasoning: a sum
over completion tokens, divided by the step's token count later). Each workload keeps what is
its own: which samples form a group, which are filtered, the unit of the policy ratio.
"""

from __future__ import annotations

import torch

__all__ = ["group_advantages", "clipped_terms", "clipped_surrogate", "ratio_stats"]


def group_advantages(values: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Each sample's advantage against its group, ``(v - mean) / (std + eps)`` with the
    population std (GRPO's paper); ``values`` lists groups of ``group_size`` one after another.

    A group whose values are all equal has no signal and gets exactly 0, for any ``eps``: not
    ``0/0 = nan`` with ``eps=0``, nor the rounding residue of a mean that float32 cannot hold
    (three rewards of 0.1) divided by ``eps``, which would push every sample of the group the
    same way by a made-up amount.

    >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.1, 0.1]), group_size=2)
    tensor([ 1.0000, -1.0000, -1.0000,  1.0000,  0.0000,  0.0000])
    """
    if group_size < 1 or values.numel() % group_size:
        raise ValueError(f"{values.numel()} samples do not split into groups of {group_size}.")
    v = values.float().reshape(-1, group_size)  # (groups, n)
    mean = v.mean(dim=1, keepdim=True)
    std = v.std(dim=1, unbiased=False, keepdim=True)
    constant = (v == v[:, :1]).all(dim=1, keepdim=True)
    adv = torch.where(constant, torch.zeros_like(v), (v - mean) / (std + eps))
    return adv.reshape(-1)


def clipped_terms(ratio: torch.Tensor, adv: torch.Tensor, clip_coef: float) -> torch.Tensor:
    """PPO's clipped policy objective per ratio, as a loss: ``max(-A r, -A clip(r, 1-c, 1+c))``
    (``adv`` broadcast against ``ratio``)."""
    return torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip_coef, 1 + clip_coef))


def clipped_surrogate(log_ratio: torch.Tensor, adv: torch.Tensor, clip_coef: float) -> torch.Tensor:
    """The mean of :func:`clipped_terms` over every ratio.

    >>> lr = torch.log(torch.tensor([1.5, 0.5]))  # ratios 1.5 (A=+1) and 0.5 (A=-1)
    >>> clipped_surrogate(lr, torch.tensor([1.0, -1.0]), 0.2)  # (-1.2 + 0.8) / 2
    tensor(-0.2000)
    """
    return clipped_terms(log_ratio.exp(), adv, clip_coef).mean()


@torch.no_grad()
def ratio_stats(log_ratio: torch.Tensor, clip_coef: float) -> dict:
    """``approx_kl`` (the k3 estimator of KL(old || new)) and ``clip_fraction``, means."""
    ratio = log_ratio.exp()
    return {"approx_kl": ((ratio - 1) - log_ratio).mean(),
            "clip_fraction": ((ratio - 1.0).abs() > clip_coef).float().mean()}
