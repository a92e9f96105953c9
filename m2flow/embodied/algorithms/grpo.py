"""Embodied GRPO: group-relative episode advantages (no critic), the clipped policy loss and its
update loop (:meth:`GRPO.train`).

Envs come in groups of ``group_size`` that reset to one initial state; each env's first
episode of an iteration is one sample of its group, its advantage against the group goes to
every step of it, and groups whose episodes all share one outcome are dropped (see
:mod:`m2flow.embodied.algorithms.helpers.advantages`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.algorithms.helpers.advantages import first_episodes, keep_groups
from m2flow.embodied.algorithms.base import (
    Algorithm, AlgorithmConfig, check_field, flatten_valid, loss_metrics)
from m2flow.embodied.algorithms.helpers.demo_term import DemoTerm, DemoTermConfig
from m2flow.embodied.algorithms.helpers.losses import LOGPROB_LEVELS, clipped_policy_terms
from m2flow.runs.learner import Means, minibatch_generator
from m2flow.runs.rl import group_advantages


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
    ``demo_coef``, the demonstrations' NLL in the loss (:mod:`~m2flow.embodied.algorithms.
    demo_term`)."""

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
