"""Clipped PPO: its config and its loss, a pure function of a policy and a minibatch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict

from m2flow.policies import Policy


@dataclass
class PPOConfig:
    """PPO (and embodied GRPO) hyper-parameters, named as in the papers and cleanRL."""

    name: str = "ppo"
    """'ppo' (GAE with a critic) or 'grpo' (group-relative episode advantages, no critic)."""
    learning_rate: float = 3e-4
    """Adam step size."""
    anneal_lr: bool = False
    """Decay the step size linearly to 0 over runner.num_iterations (cleanRL's anneal_lr)."""
    gamma: float = 0.8
    """Discount factor."""
    gae_lambda: float = 0.9
    """GAE lambda."""
    update_epochs: int = 4
    """Passes over each iteration's batch."""
    num_minibatches: int = 4
    """Minibatches per epoch."""
    clip_coef: float = 0.2
    """Policy ratio clip range."""
    clip_vloss: bool = False
    """Clip the value loss around the behaviour values too."""
    vf_coef: float = 0.5
    """Value loss weight."""
    ent_coef: float = 0.0
    """Entropy bonus weight."""
    max_grad_norm: float = 0.5
    """Global gradient-norm clip."""
    norm_adv: bool = True
    """Normalise advantages per minibatch."""
    target_kl: Optional[float] = 0.1
    """Stop the epoch loop early once approx KL exceeds this (None: never)."""
    group_size: int = 8
    """GRPO: envs per group; a group resets to one initial state (env.num_envs must be a
    multiple). Each env's first episode of an iteration is its sample."""
    filter_low: float = 0.0
    """GRPO: keep a group only if its success rate is > filter_low ..."""
    filter_high: float = 1.0
    """... and < filter_high (defaults: drop all-failure and all-success groups)."""
    logprob_level: str = "chunk"
    """GRPO: the unit of the policy ratio: 'token' (each action token), 'action' (the tokens
    of one action summed) or 'chunk' (everything one policy call decided, summed)."""


def ppo_loss(
    policy: Policy,
    mb: TensorDict,
    *,
    clip_coef: float,
    vf_coef: float,
    ent_coef: float,
    clip_vloss: bool = False,
    norm_adv: bool = True,
) -> TensorDict:
    """PPO loss terms for minibatch ``mb`` (keys obs, action, log_prob, value, advantage, return).

    Returns a TensorDict of ``loss_policy``, ``loss_value``, ``loss_entropy`` (sum them to
    train) and diagnostics ``approx_kl``, ``clip_fraction``, ``entropy``.
    """
    out = policy.evaluate(mb)
    log_ratio = out["log_prob"] - mb["log_prob"]
    adv = mb["advantage"]
    if norm_adv and adv.numel() > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    pg_loss = clipped_surrogate(log_ratio, adv, clip_coef)
    value, ret = out["value"], mb["return"]
    if clip_vloss:
        clipped = mb["value"] + (value - mb["value"]).clamp(-clip_coef, clip_coef)
        v_loss = 0.5 * torch.max((value - ret) ** 2, (clipped - ret) ** 2).mean()
    else:
        v_loss = 0.5 * ((value - ret) ** 2).mean()
    entropy = out["entropy"].mean()
    return TensorDict(
        {
            "loss_policy": pg_loss,
            "loss_value": vf_coef * v_loss,
            "loss_entropy": -ent_coef * entropy,
            **_ratio_stats(log_ratio, clip_coef),
            "entropy": entropy.detach(),
        },
        batch_size=[],
    )


LOGPROB_LEVELS = ("token", "action", "chunk")


def grpo_loss(policy: Policy, mb: TensorDict, *, clip_coef: float, ent_coef: float,
              level: str = "chunk", action_dim: int = 1) -> TensorDict:
    """GRPO's clipped policy loss (no critic) for minibatch ``mb`` (obs, the actions, the
    behaviour log-probs and a per-sample ``advantage``), at log-prob ``level``."""
    out = policy.evaluate(mb)
    if level == "chunk":
        new, old = out["log_prob"], mb["log_prob"]
    else:
        if "token_log_prob" not in mb.keys():
            raise ValueError(
                f"algorithm.logprob_level={level!r} needs per-token log-probs, which this "
                "policy does not produce; use 'chunk' (or a VLA policy)."
            )
        new, old = out["token_log_prob"], mb["token_log_prob"]  # (B, Q)
        if level == "action":
            new = new.reshape(new.shape[0], -1, action_dim).sum(-1)
            old = old.reshape(old.shape[0], -1, action_dim).sum(-1)
    log_ratio = new - old
    adv = mb["advantage"].reshape(-1, *([1] * (log_ratio.ndim - 1))).expand_as(log_ratio)
    entropy = out["entropy"].mean()
    return TensorDict(
        {
            "loss_policy": clipped_surrogate(log_ratio, adv, clip_coef),
            "loss_entropy": -ent_coef * entropy,
            **_ratio_stats(log_ratio, clip_coef),
            "entropy": entropy.detach(),
        },
        batch_size=[],
    )


def clipped_surrogate(log_ratio: torch.Tensor, adv: torch.Tensor, clip_coef: float) -> torch.Tensor:
    """PPO's clipped policy objective, as a loss: mean of max(-A r, -A clip(r))."""
    ratio = log_ratio.exp()
    return torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip_coef, 1 + clip_coef)).mean()


@torch.no_grad()
def _ratio_stats(log_ratio: torch.Tensor, clip_coef: float) -> dict:
    ratio = log_ratio.exp()
    return {"approx_kl": ((ratio - 1) - log_ratio).mean(),
            "clip_fraction": ((ratio - 1.0).abs() > clip_coef).float().mean()}


def total_loss(terms: TensorDict) -> torch.Tensor:
    """Sum of every ``loss_*`` term."""
    return sum(v for k, v in terms.items() if k.startswith("loss_"))
