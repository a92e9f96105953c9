"""Loss pieces PPO and GRPO share: the clipped surrogate and the ratio diagnostics."""

from __future__ import annotations

import torch


def clipped_surrogate(log_ratio: torch.Tensor, adv: torch.Tensor, clip_coef: float) -> torch.Tensor:
    """PPO's clipped policy objective, as a loss: mean of max(-A r, -A clip(r)).

    >>> lr = torch.log(torch.tensor([1.5, 0.5]))  # ratios 1.5 (A=+1) and 0.5 (A=-1)
    >>> clipped_surrogate(lr, torch.tensor([1.0, -1.0]), 0.2)  # (-1.2 + 0.8) / 2
    tensor(-0.2000)
    """
    ratio = log_ratio.exp()
    return torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip_coef, 1 + clip_coef)).mean()


@torch.no_grad()
def ratio_stats(log_ratio: torch.Tensor, clip_coef: float) -> dict:
    """``approx_kl`` (the k3 estimator of KL(old || new)) and ``clip_fraction``, means."""
    ratio = log_ratio.exp()
    return {"approx_kl": ((ratio - 1) - log_ratio).mean(),
            "clip_fraction": ((ratio - 1.0).abs() > clip_coef).float().mean()}
