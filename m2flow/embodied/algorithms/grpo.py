"""Embodied GRPO: group-relative episode advantages (no critic), the clipped policy loss and its
update loop (:meth:`GRPO.train`).

Envs come in groups of ``group_size`` that reset to the same initial state (LIBERO init-state
id, ManiSkill seed); each env's first episode of an iteration is one sample of its group
(:func:`first_episodes`). Each episode's advantage is its return against its group,
``(R - mean(group)) / (std(group) + eps)`` (:func:`m2flow.runs.rl.group_advantages`, shared
with reasoning), and every action of the episode carries it. A group whose episodes all
succeeded or all failed says nothing about which actions were better; groups whose success
rate lies outside ``[low, high]`` are dropped (:func:`keep_groups`; by default: keep a group
unless all its episodes share one outcome).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.algorithms.base import (
    Algorithm, AlgorithmConfig, check_field, flatten_valid, loss_metrics)
from m2flow.embodied.algorithms.helpers.demo_term import DemoTerm, DemoTermConfig
from m2flow.runs.learner import Means, minibatch_generator
from m2flow.runs.rl import LOGPROB_LEVELS, clipped_policy_terms, group_advantages


@dataclass
class GRPOConfig(DemoTermConfig, AlgorithmConfig):
    """Embodied GRPO hyper-parameters."""

    name: str = "grpo"
    """Registered algorithm name."""
    learning_rate: float = 1e-5
    """Adam step size."""
    update_epochs: int = 1
    """Passes over each iteration's batch."""
    num_minibatches: int = 1
    """Minibatches per epoch."""
    clip_coef: float = 0.2
    """Policy ratio clip range."""
    ent_coef: float = 0.0
    """Entropy bonus weight."""
    target_kl: Optional[float] = None
    """Stop the epoch loop early once approx KL exceeds this (None: never)."""
    group_size: int = 8
    """Envs per group; a group resets to one initial state (env.num_envs must be a multiple).
    Each env's first episode of an iteration is its sample."""
    filter_low: float = 0.0
    """Keep a group only if its success rate is > filter_low ..."""
    filter_high: float = 1.0
    """... and < filter_high (defaults: drop all-failure and all-success groups; -1 and 2
    keep every group)."""
    logprob_level: str = "chunk"
    """The unit of the policy ratio: 'token' (each action token), 'action' (the tokens of
    one action summed) or 'chunk' (everything one policy call decided, summed)."""

    def validate(self) -> None:
        super().validate()
        check_field(self, "clip_coef", self.clip_coef > 0, "must be > 0.")
        check_field(self, "ent_coef", self.ent_coef >= 0, "must be >= 0.")
        check_field(self, "target_kl", self.target_kl is None or self.target_kl > 0,
                    "must be > 0, or null to never stop early.")
        check_field(self, "group_size", self.group_size >= 2,
                    "must be >= 2 (a group of one has no advantage against its group).")
        check_field(self, "filter_low", self.filter_low < self.filter_high,
                    f"must be < algorithm.filter_high={self.filter_high!r} (no group's success "
                    "rate lies between them: every group would be dropped).")
        check_field(self, "logprob_level", self.logprob_level in LOGPROB_LEVELS,
                    f"use one of {', '.join(LOGPROB_LEVELS)}.")
        self.validate_demo_term()


class GRPO(Algorithm):
    """``algorithm=grpo``: each env's first episode is a sample of its group; no critic; with
    ``demo_coef``, the demonstrations' NLL in the loss
    (:mod:`~m2flow.embodied.algorithms.helpers.demo_term`)."""

    config_class = GRPOConfig
    needs_critic = False

    def __init__(self, cfg, *, action_dim: int, seed: int):
        super().__init__(cfg, action_dim=action_dim, seed=seed)
        self.demos = DemoTerm(cfg, action_dim=action_dim, seed=seed)

    @classmethod
    def reset_group_size(cls, cfg) -> int:
        return cfg.group_size

    @torch.no_grad()
    def prepare(self, policy, traj: TensorDict, *, iteration: int,
                staleness: int) -> tuple[TensorDict, dict]:
        metrics = self.add_group_advantages(traj)
        self.demos.start(iteration)
        return flatten_valid(traj), metrics

    @torch.no_grad()
    def add_group_advantages(self, traj: TensorDict) -> dict:
        """Writes ``advantage``, ``return`` and ``valid`` into ``traj`` (N, T): each env's
        first episode gets its advantage against the group on every step; other steps and
        filtered groups are not valid. Returns the ``grpo/*`` metrics: ``groups_kept`` (the
        share of groups the filter kept) and ``groups_mixed`` (the share whose episodes did
        not all share one outcome, whatever the filter: where sampling changed the outcome;
        a policy whose success is decided by the initial state has few)."""
        c = self.cfg
        ret, success, steps = first_episodes(traj[keys.REWARD], traj[keys.DONE],
                                             traj[keys.SUCCESS])
        # success_at_end: the flag of the first episode's last transition (its steps: a prefix)
        flags = traj.get(keys.SUCCESS_AT_END, traj[keys.SUCCESS])  # (N, T)
        at_end = flags[torch.arange(len(flags), device=flags.device), steps.long().sum(1) - 1]
        if keys.VALID in traj.keys():  # an episode a simulator restart lost is not a sample
            steps &= traj[keys.VALID]
            lost = ~traj[keys.VALID].all(1)
            success = success & ~lost
            at_end = at_end & ~lost
        keep = keep_groups(success, c.group_size, c.filter_low, c.filter_high)  # (checks sizes)
        mixed = keep_groups(success, c.group_size)  # neither all-success nor all-failure
        adv = group_advantages(ret, c.group_size)
        traj[keys.ADVANTAGE] = adv[:, None].expand(traj.shape).clone()
        traj[keys.RETURN] = ret[:, None].expand(traj.shape).clone()
        traj[keys.VALID] = steps & keep[:, None]
        return {"grpo/groups_kept": float(keep.float().mean()),
                "grpo/groups_mixed": float(mixed.float().mean()),
                "grpo/episode_success_once": float(success.float().mean()),
                "grpo/episode_success_at_end": float(at_end.float().mean()),
                "grpo/episode_return": float(ret.mean())}

    def loss(self, policy, mb: TensorDict) -> TensorDict:
        c = self.cfg
        terms = grpo_loss(policy, mb, clip_coef=c.clip_coef, ent_coef=c.ent_coef,
                          level=c.logprob_level, action_dim=self.action_dim)
        terms.update(self.demos.terms(policy, mb.device))
        return terms

    def train(self, policy, batch: TensorDict, trainer, *, iteration: int, seed: int) -> dict:
        """``update_epochs`` passes over ``batch`` in ``num_minibatches`` minibatches of a
        seeded permutation, one optimiser step each on :meth:`loss` (with the demonstrations'
        next rows); after each epoch, the stop at ``target_kl``. Reports the minibatches'
        mean terms."""
        c = self.cfg
        gen, means, stopped = minibatch_generator(seed, iteration), Means(), False
        for _ in range(c.update_epochs):
            for mb in trainer.minibatches(batch, c.num_minibatches, gen):
                self.demos.next_minibatch()
                terms = trainer.gradients(mb, lambda m: self.loss(policy, m),
                                          micro_batch_size=c.micro_batch_size)
                terms["grad_norm"] = trainer.step()
                means.add(terms)
            if self.stop_early(terms):
                stopped = True
                break
        return loss_metrics(means.means(), early_stop=stopped)

    def stop_early(self, terms: dict) -> bool:
        """After an epoch, on its last minibatch's terms: past ``target_kl``."""
        return self.cfg.target_kl is not None and terms["approx_kl"] > self.cfg.target_kl


def grpo_loss(policy, mb: TensorDict, *, clip_coef: float, ent_coef: float,
              level: str = "chunk", action_dim: int = 1) -> TensorDict:
    """GRPO's clipped policy loss (no critic) for minibatch ``mb`` (obs, the actions, the
    behaviour log-probs and a per-sample ``advantage``), at log-prob ``level``; a mean over
    samples (and their tokens/actions, the same number for every sample)."""
    return clipped_policy_terms(policy, mb, clip_coef=clip_coef, ent_coef=ent_coef,
                                level=level, action_dim=action_dim)


def keep_groups(success: torch.Tensor, group_size: int, low: float = 0.0,
                high: float = 1.0) -> torch.Tensor:
    """Per-episode mask: True where the group's success rate satisfies ``low < rate < high``;
    the defaults drop all-failure (rate 0) and all-success (rate 1) groups.

    >>> keep_groups(torch.tensor([1, 1, 0, 0, 0, 1, 1, 1]).bool(), group_size=2)
    tensor([False, False, False, False,  True,  True, False, False])
    """
    rate = _grouped(success.float(), group_size).mean(dim=1)
    keep = (rate > low) & (rate < high)
    return keep.repeat_interleave(group_size)


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1 or x.numel() % group_size:
        raise ValueError(
            f"{x.numel()} episodes do not split into groups of algorithm.group_size="
            f"{group_size}; make env.num_envs (times env workers) a multiple of it."
        )
    return x.reshape(-1, group_size)


def first_episodes(reward: torch.Tensor, done: torch.Tensor,
                   success: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each env's first episode in an (N, T) trajectory: (return (N,), success (N,), the mask
    (N, T) of its steps). An episode still running at T counts with what it has so far.

    >>> d = torch.tensor([[False, True, False], [False, False, False]])
    >>> ret, ok, steps = first_episodes(torch.ones(2, 3), d, d)
    >>> ret.tolist(), ok.tolist(), steps.tolist()
    ([2.0, 3.0], [True, False], [[True, True, False], [True, True, True]])
    """
    ended_before = (torch.cumsum(done.long(), dim=1) - done.long()) > 0
    steps = ~ended_before
    return (reward * steps).sum(1), (success & steps).any(1), steps
