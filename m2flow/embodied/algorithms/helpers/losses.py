"""Loss pieces embodied PPO and GRPO share: the unit of the policy ratio (a whole chunk, each
action or each token of a VLA's output) and the clipped policy terms both build on it. The
clipped surrogate and its diagnostics are the maths both workloads share
(:mod:`m2flow.runs.rl`)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.runs.rl import clipped_surrogate, ratio_stats

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


def clipped_policy_terms(policy, mb: TensorDict, *, clip_coef: float, ent_coef: float,
                         level: str = "chunk", action_dim: int = 1,
                         value_term: Optional[Callable[[TensorDict], torch.Tensor]] = None
                         ) -> TensorDict:
    """The clipped policy loss of minibatch ``mb`` (obs, the actions, the behaviour log-probs
    and a per-sample ``advantage``), the ratio at log-prob ``level`` and each sample's
    advantage on every ratio of it: a TensorDict of ``loss_policy``, ``value_term``'s
    ``loss_value`` when given (called with the policy's ``evaluate_actions`` output: a
    critic's weighted loss), ``loss_entropy`` and ``loss_aux`` when the policy returns one
    (the runner sums the ``loss_*`` terms in this order), and diagnostics ``approx_kl``,
    ``clip_fraction``, ``entropy``; each a mean over samples (and their ratios).

    >>> class Fixed:  # log-prob -1 where the rollout logged -1.5 (ratio e^0.5), entropy 1
    ...     def evaluate_actions(self, mb):
    ...         return TensorDict({keys.LOG_PROB: torch.full((2,), -1.0),
    ...                            keys.ENTROPY: torch.ones(2)}, [2])
    >>> mb = TensorDict({keys.LOG_PROB: torch.full((2,), -1.5),
    ...                  keys.ADVANTAGE: torch.tensor([1.0, -1.0])}, [2])
    >>> t = clipped_policy_terms(Fixed(), mb, clip_coef=0.2, ent_coef=0.1)
    >>> [k for k in t.keys() if k.startswith("loss_")], round(float(t["loss_policy"]), 4)
    (['loss_policy', 'loss_entropy'], 0.2244)
    """
    out = policy.evaluate_actions(mb)
    new, old = level_log_probs(out, mb, level, action_dim)
    log_ratio = new - old
    pg_loss = clipped_surrogate(log_ratio, per_ratio(mb[keys.ADVANTAGE], log_ratio), clip_coef)
    value = {} if value_term is None else {"loss_value": value_term(out)}
    entropy = out[keys.ENTROPY].mean()
    terms = TensorDict(
        {
            "loss_policy": pg_loss,
            **value,
            "loss_entropy": -ent_coef * entropy,
            **ratio_stats(log_ratio, clip_coef),
            "entropy": entropy.detach(),
        },
        batch_size=[],
    )
    if keys.AUX_LOSS in out.keys():  # the policy's own (e.g. policy.state_aux)
        terms["loss_aux"] = out[keys.AUX_LOSS].mean()
    return terms
