"""GRPO for language models: group-normalised advantages and the token-level clipped loss.

Each prompt's ``n`` completions form a group; a completion's advantage is its reward against
its group, ``(r - mean) / (std + eps)`` (the same formula as embodied GRPO's, kept here because
reasoning never imports embodied), and every one of its tokens carries it. The loss is
summed over tokens here and divided by the step's total token count after the last
micro-batch (DAPO's token-level mean), so a step's gradient does not depend on how its
completions were cut into micro-batches or when they arrived.
"""

from __future__ import annotations

import torch

__all__ = ["group_advantages", "token_loss"]


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Per-completion advantage against its group; ``rewards`` lists groups one after another.
    A group whose rewards are all equal has no signal and gets exactly 0 for any ``eps``
    (not ``0/0 = nan`` with ``eps=0``, nor a rounding residue of its mean over ``eps``).

    >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.1, 0.1]), group_size=2)
    tensor([ 1.0000, -1.0000, -1.0000,  1.0000,  0.0000,  0.0000])
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} completions do not split into groups of "
                         f"{group_size}; rollout.n must divide them.")
    r = rewards.float().reshape(-1, group_size)  # (groups, n)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)  # population std, as GRPO's paper
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)
    adv = torch.where(constant, torch.zeros_like(r), (r - mean) / (std + eps))
    return adv.reshape(-1)


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
    a = adv.unsqueeze(-1)
    per_token = torch.max(-a * ratio, -a * ratio.clamp(1 - clip_coef, 1 + clip_coef))
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
