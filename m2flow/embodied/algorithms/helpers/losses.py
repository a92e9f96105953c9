"""Loss pieces embodied PPO and GRPO share: the unit of the policy ratio (a whole chunk, each
action or each token of a VLA's output). The clipped surrogate and its diagnostics are the
maths both workloads share (:mod:`m2flow.runs.rl`)."""

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
