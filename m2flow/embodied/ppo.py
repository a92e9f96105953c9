"""Clipped PPO: its config and its loss, a pure function of a policy and a minibatch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict

from m2flow.policies import Policy


@dataclass
class PPOConfig:
    """PPO hyper-parameters, named as in the paper and cleanRL."""

    name: str = "ppo"
    """Algorithm id."""
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
    ratio = log_ratio.exp()
    adv = mb["advantage"]
    if norm_adv and adv.numel() > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip_coef, 1 + clip_coef)).mean()
    value, ret = out["value"], mb["return"]
    if clip_vloss:
        clipped = mb["value"] + (value - mb["value"]).clamp(-clip_coef, clip_coef)
        v_loss = 0.5 * torch.max((value - ret) ** 2, (clipped - ret) ** 2).mean()
    else:
        v_loss = 0.5 * ((value - ret) ** 2).mean()
    entropy = out["entropy"].mean()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - log_ratio).mean()
        clip_fraction = ((ratio - 1.0).abs() > clip_coef).float().mean()
    return TensorDict(
        {
            "loss_policy": pg_loss,
            "loss_value": vf_coef * v_loss,
            "loss_entropy": -ent_coef * entropy,
            "approx_kl": approx_kl,
            "clip_fraction": clip_fraction,
            "entropy": entropy.detach(),
        },
        batch_size=[],
    )


def total_loss(terms: TensorDict) -> torch.Tensor:
    """Sum of every ``loss_*`` term."""
    return sum(v for k, v in terms.items() if k.startswith("loss_"))
