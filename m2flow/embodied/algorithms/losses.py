"""Loss pieces PPO and GRPO share: the clipped surrogate, the ratio diagnostics and the unit
of the policy ratio (a whole chunk, each action or each token of a VLA's output)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from m2flow import keys

LOGPROB_LEVELS = ("token", "action", "chunk")
"""The unit of the policy ratio: 'token' (each action token), 'action' (the tokens of one
action summed) or 'chunk' (everything one policy call decided, summed)."""


def level_log_probs(out: TensorDict, mb: TensorDict, level: str,
                    action_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(new, old) log-probs at ``level``: (B,) for 'chunk', (B, Q) per token or (B, Q / A)
    per action from the policy's ``token_log_prob`` (``out``: ``evaluate_actions`` of
    ``mb``; ``mb``: what the rollout recorded). A chunk of 8 actions of 7 tokens is one
    ratio of 56 tokens' log-probs summed: one update moves it far more than any one token's.

    >>> old = TensorDict({keys.LOG_PROB: torch.tensor([-3.0]),
    ...                   keys.TOKEN_LOG_PROB: torch.tensor([[-1.0, -0.5, -1.0, -0.5]])}, [1])
    >>> new = TensorDict({keys.LOG_PROB: torch.tensor([-2.0]),
    ...                   keys.TOKEN_LOG_PROB: torch.tensor([[-0.5, -0.5, -0.5, -0.5]])}, [1])
    >>> [n - o for n, o in (level_log_probs(new, old, lv, 2) for lv in LOGPROB_LEVELS)]
    [tensor([[0.5000, 0.0000, 0.5000, 0.0000]]), tensor([[0.5000, 0.5000]]), tensor([1.])]
    """
    if level == "chunk":
        return out[keys.LOG_PROB], mb[keys.LOG_PROB]
    if keys.TOKEN_LOG_PROB not in mb.keys():
        raise ValueError(
            f"algorithm.logprob_level={level!r} needs per-token log-probs, which this "
            "policy does not produce; use 'chunk' (or a VLA policy)."
        )
    new, old = out[keys.TOKEN_LOG_PROB], mb[keys.TOKEN_LOG_PROB]  # (B, Q)
    if level == "action":
        new = new.reshape(new.shape[0], -1, action_dim).sum(-1)  # (B, Q / A)
        old = old.reshape(old.shape[0], -1, action_dim).sum(-1)
    return new, old


def per_ratio(adv: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    """A per-sample advantage (B,) spread over each sample's ratios (B, ...)."""
    return adv.reshape(-1, *([1] * (log_ratio.ndim - 1))).expand_as(log_ratio)


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
