"""GRPO for language models: group-normalised advantages and the token-level clipped loss.

Each prompt's ``n`` completions form a group; a completion's advantage is its reward against
its group, ``(r - mean) / (std + eps)`` (:mod:`m2flow.runs.rl`, the maths embodied GRPO
shares), and every one of its tokens carries it. The loss (the shared clipped objective) is
summed over tokens here and divided by the step's total token count after the last
micro-batch (DAPO's token-level mean), so a step's gradient does not depend on how its
completions were cut into micro-batches or when they arrived.
"""

from __future__ import annotations

import torch

from m2flow.runs.rl import clipped_terms, group_advantages

__all__ = ["completion_advantages", "token_loss"]


def completion_advantages(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """The advantages of one prompt's completions, one group (:func:`m2flow.runs.rl.
    group_advantages`, the rule embodied GRPO uses too: a group of equal rewards gets 0).

    >>> completion_advantages(torch.tensor([3.0, 1.0]), eps=0.0)
    tensor([ 1., -1.])
    """
    return group_advantages(rewards, rewards.numel(), eps)


def token_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
               mask: torch.Tensor, clip_coef: float, ref_logp: torch.Tensor | None = None,
               kl_coef: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Sum over the completion tokens of ``mask`` of the clipped policy loss (+ KL to the
    reference, k3 estimator); ``logp``, ``old_logp``, ``ref_logp``, ``mask``: (B, C);
    ``adv``: (B,). Returns (loss sum, sums of diagnostics over the same tokens).

    >>> lp = torch.log(torch.tensor([[0.5, 0.5]]))
    >>> loss, _ = token_loss(lp, lp, torch.tensor([2.0]), torch.tensor([[True, False]]), 0.2)
    >>> loss.item()
    -2.0
    """
    mask = mask.float()
    log_ratio = logp - old_logp
    ratio = log_ratio.exp()
    per_token = clipped_terms(ratio, adv.unsqueeze(-1), clip_coef)
    stats = {}
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp - logp
        kl = d.exp() - d - 1
        per_token = per_token + kl_coef * kl
        stats["kl_ref"] = (kl.detach() * mask).sum()
    with torch.no_grad():
        stats["clip_fraction"] = (((ratio - 1).abs() > clip_coef).float() * mask).sum()
        stats["approx_kl"] = (((ratio - 1) - log_ratio) * mask).sum()
    return (per_token * mask).sum(), stats
