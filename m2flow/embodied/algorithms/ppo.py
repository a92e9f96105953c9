"""Clipped PPO with GAE: its config, advantages on (N, T) trajectories, its loss and its update
loop (:meth:`PPO.train`).

The maths it calls (GAE, advantage normalisation, the clipped surrogate at a log-prob level,
explained variance, each over every data-parallel rank where it must be) is
:mod:`m2flow.runs.rl`; the learner pieces its loop takes its steps from (the Trainer's
minibatches, gradients and step; ``Means``, ``frozen_but``) are :mod:`m2flow.runs.learner`;
what the learner worker calls is the interface in :mod:`~m2flow.embodied.algorithms.base`.
The demonstration term (``demo_coef``, off by default) is
:mod:`~m2flow.embodied.algorithms.helpers.demo_term`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    batched_values,
    check_field,
    flatten_valid,
    loss_metrics,
)
from m2flow.embodied.algorithms.helpers.demo_term import DemoTerm, DemoTermConfig
from m2flow.runs.learner import Means, frozen_but, minibatch_generator
from m2flow.runs.rl import (
    LOGPROB_LEVELS,
    clipped_policy_terms,
    explained_variance,
    explained_variance_shared,
    gae,
    normalized_advantages,
)

LR_SCHEDULES = ("fixed", "adaptive")
# rsl-rl's adaptive schedule (rsl_rl.algorithms.PPO.update): the factor a minibatch's KL
# scales the step size by, and the range it stays in
ADAPTIVE_LR_FACTOR = 1.5
ADAPTIVE_LR_MIN = 1e-5
ADAPTIVE_LR_MAX = 1e-2


@dataclass
class PPOConfig(DemoTermConfig, AlgorithmConfig):
    """PPO hyper-parameters, named as in the papers and cleanRL."""

    name: str = "ppo"
    """Registered algorithm name."""
    gamma: float = 0.8
    """Discount factor."""
    gae_lambda: float = 0.9
    """GAE lambda."""
    clip_coef: float = 0.2
    """Policy ratio clip range."""
    clip_vloss: bool = False
    """Clip the value loss around the behaviour values too."""
    vf_coef: float = 0.5
    """Value loss weight."""
    ent_coef: float = 0.0
    """Entropy bonus weight."""
    norm_adv: bool = True
    """Normalise advantages per minibatch."""
    target_kl: Optional[float] = 0.1
    """Stop the epoch loop early once approx KL exceeds this (None: never)."""
    lr_schedule: str = "fixed"
    """fixed | adaptive: the step size as ``learning_rate``/``anneal_lr`` set it, or rsl-rl's
    schedule: before each minibatch's step, divided by 1.5 when its KL is above 2 x
    ``desired_kl``, multiplied by 1.5 when it is in (0, ``desired_kl`` / 2), kept in [1e-5,
    1e-2], and carried over between updates (and checkpoints); starts at ``learning_rate``.
    During a critic warm-up (the actor frozen: its KL is 0) the step size stays as it is."""
    desired_kl: float = 0.01
    """The KL between behaviour and current policy that ``lr_schedule=adaptive`` steers each
    minibatch towards (rsl-rl's desired_kl)."""
    critic_learning_rate: Optional[float] = None
    """Adam step size of the critic's parameters (``Policy.critic_parameter_names``; None:
    ``learning_rate``). A value head new to a warm-started VLA must fit returns of tens from
    zero; at a VLA's 1e-4 that takes thousands of steps, while the value loss's gradient
    through the shared backbone does not wait."""
    critic_warmup: int = 0
    """The first this many iterations train the critic alone: every parameter but the
    critic's (``Policy.critic_parameter_names``: a value head on a VLA's backbone) frozen.
    A run warm-started from behaviour cloning (``init_from``) gets a value head that BC never
    trained; its first advantages are noise, and PPO steps on them (and the value loss's
    gradient through the shared backbone) move the policy off what BC taught it."""
    logprob_level: str = "chunk"
    """The unit of the policy ratio: 'chunk' (everything one policy call decided, summed),
    'action' (the tokens of one action summed) or 'token' (each action token; VLA policies).
    A chunk's tokens summed (LIBERO's 8 x 7: 56) make a ratio one update moves far past
    ``clip_coef``."""

    def validate(self) -> None:
        super().validate()
        check_field(self, "logprob_level", self.logprob_level in LOGPROB_LEVELS,
                    f"use one of {', '.join(LOGPROB_LEVELS)}.")
        check_field(self, "gamma", 0 < self.gamma <= 1, "must be in (0, 1].")
        check_field(self, "gae_lambda", 0 <= self.gae_lambda <= 1, "must be in [0, 1].")
        check_field(self, "clip_coef", self.clip_coef > 0, "must be > 0.")
        check_field(self, "vf_coef", self.vf_coef >= 0, "must be >= 0.")
        check_field(self, "ent_coef", self.ent_coef >= 0, "must be >= 0.")
        check_field(self, "target_kl", self.target_kl is None or self.target_kl > 0,
                    "must be > 0, or null to never stop early.")
        check_field(self, "lr_schedule", self.lr_schedule in LR_SCHEDULES,
                    f"use one of {', '.join(LR_SCHEDULES)}.")
        check_field(self, "lr_schedule", not (self.lr_schedule == "adaptive" and self.anneal_lr),
                    "adaptive sets the step size itself; set algorithm.anneal_lr=false, or "
                    "lr_schedule=fixed to anneal.")
        check_field(self, "desired_kl", self.desired_kl > 0, "must be > 0.")
        check_field(self, "critic_learning_rate",
                    self.critic_learning_rate is None or self.critic_learning_rate > 0,
                    "must be > 0, or null for learning_rate.")
        check_field(self, "critic_warmup", self.critic_warmup >= 0,
                    "must be >= 0 (iterations that train the critic alone).")
        self.validate_demo_term()


class PPO(Algorithm):
    """``algorithm=ppo``: GAE advantages with the policy's critic, the clipped surrogate, a
    value loss and an entropy bonus; stops an update early past ``target_kl``; with
    ``lr_schedule=adaptive``, adapts the step size to each minibatch's KL; with
    ``demo_coef``, adds the demonstrations' NLL
    (:mod:`~m2flow.embodied.algorithms.helpers.demo_term`)."""

    config_class = PPOConfig
    needs_critic = True

    def __init__(self, cfg, *, action_dim: int, seed: int):
        super().__init__(cfg, action_dim=action_dim, seed=seed)
        self.lr = cfg.learning_rate
        """The adapted step size (``lr_schedule=adaptive``): the last minibatch's."""
        self.demos = DemoTerm(cfg, action_dim=action_dim, seed=seed)
        self.actor_frozen = False
        """Whether this update trains the critic alone (its KL then says nothing)."""

    @torch.no_grad()
    def prepare(self, policy, traj: TensorDict, *, iteration: int,
                staleness: int) -> tuple[TensorDict, dict]:
        self.add_advantages(policy, traj, revalue=staleness > 0)
        self.demos.start(iteration)
        self.actor_frozen = self.critic_only(iteration)
        return flatten_valid(traj), {}

    @torch.no_grad()
    def add_advantages(self, policy, traj: TensorDict, revalue: bool = False) -> None:
        """GAE with one critic throughout, written into ``traj`` (N, T). ``revalue``: the
        trajectory was collected with older weights (learner overlap); its stored values
        come from an older critic, and mixing them with this critic's next-state values
        makes the returns off by about (V_new - V_old) * gamma / (1 - gamma * lambda), which
        the critic then chases until it diverges. So the values are recomputed; the behaviour
        log-probs stay (PPO's ratio needs them)."""
        k = self.cfg.micro_batch_size  # N*T observations: in forwards of k
        if revalue:
            traj[keys.VALUE] = batched_values(policy, traj[keys.OBS].reshape(-1), k).reshape(traj.shape)
        next_obs = traj[keys.NEXT_OBS].reshape(-1)  # (N*T,)
        traj[keys.NEXT_VALUE] = batched_values(policy, next_obs, k).reshape(traj.shape)
        adv, ret = gae(
            traj[keys.REWARD], traj[keys.VALUE], traj[keys.NEXT_VALUE],
            traj[keys.TERMINATED], traj[keys.DONE],
            gamma=self.cfg.gamma, gae_lambda=self.cfg.gae_lambda,
        )
        traj[keys.ADVANTAGE], traj[keys.RETURN] = adv, ret

    def train(self, policy, batch: TensorDict, trainer, *, iteration: int, seed: int) -> dict:
        """``update_epochs`` passes over ``batch`` in ``num_minibatches`` minibatches of a
        seeded permutation, one optimiser step each; only :meth:`trained_parameters` train.
        Each minibatch: the demonstrations' next rows, advantages normalised over the whole
        minibatch (before micro-batches; with several ranks, over every rank's share), the
        gradients of :meth:`loss`, the adaptive step size on its KL, the step. After each
        epoch, the stop at ``target_kl``. Reports the minibatches' mean terms and the batch's
        explained variance."""
        c = self.cfg
        gen, means, stopped = minibatch_generator(seed, iteration), Means(), False
        with frozen_but(policy, self.trained_parameters(policy, iteration)):
            for _ in range(c.update_epochs):
                for mb in trainer.minibatches(batch, c.num_minibatches, gen):
                    self.demos.next_minibatch()
                    if c.norm_adv:
                        mb.rows = normalized_advantages(mb.rows, self.data_parallel)
                    terms = trainer.gradients(mb, lambda m: self.loss(policy, m),
                                              micro_batch_size=c.micro_batch_size)
                    lr = self.adapt_learning_rate(terms)
                    if lr is not None:
                        trainer.set_lr(lr)
                    terms["grad_norm"] = trainer.step()
                    means.add(terms)
                if self.stop_early(terms):
                    stopped = True
                    break
        metrics = loss_metrics(means.means(), early_stop=stopped,
                               critic_only=self.critic_only(iteration))
        dp = self.data_parallel
        pred, target = batch[keys.VALUE], batch[keys.RETURN]
        metrics["loss/explained_variance"] = (explained_variance_shared(pred, target, dp)
                                              if dp.active else explained_variance(pred, target))
        return metrics

    def loss(self, policy, mb: TensorDict) -> TensorDict:
        c = self.cfg
        terms = ppo_loss(policy, mb, clip_coef=c.clip_coef, vf_coef=c.vf_coef,
                         ent_coef=c.ent_coef, clip_vloss=c.clip_vloss,
                         level=c.logprob_level, action_dim=self.action_dim)
        terms.update(self.demos.terms(policy, mb.device))
        return terms

    def stop_early(self, terms: dict) -> bool:
        """After an epoch, on its last minibatch's terms: past ``target_kl``."""
        return self.cfg.target_kl is not None and terms["approx_kl"] > self.cfg.target_kl

    def learning_rate(self, iteration: int, *, num_iterations: int) -> float:
        """The base's schedule, or with ``lr_schedule=adaptive`` the step size as the last
        minibatch left it (``learning_rate`` before the first)."""
        if self.cfg.lr_schedule != "adaptive":
            return super().learning_rate(iteration, num_iterations=num_iterations)
        return self.lr

    def adapt_learning_rate(self, terms: dict) -> Optional[float]:
        """The step size of a minibatch's step: rsl-rl's adaptive rule on its ``approx_kl``
        (None, the step size kept, with ``lr_schedule=fixed`` or while the actor is frozen). rsl-rl takes the analytic KL between the behaviour and the
        current Gaussians, averaged over the minibatch; ``approx_kl`` estimates the same
        KL(old || new) from the log-prob ratios of the actions taken (the k3 estimator,
        :func:`~m2flow.runs.rl.ratio_stats`), so it also works for policies whose
        distribution has no closed-form KL.

        >>> cfg = PPOConfig(lr_schedule="adaptive", learning_rate=1e-3)
        >>> ppo = PPO(cfg, action_dim=1, seed=0)
        >>> [round(ppo.adapt_learning_rate({"approx_kl": kl}), 6) for kl in (0.03, 0.01, 0.001)]
        [0.000667, 0.000667, 0.001]
        """
        c = self.cfg
        if c.lr_schedule != "adaptive" or self.actor_frozen:
            return None
        kl = float(terms["approx_kl"])
        if kl > 2.0 * c.desired_kl:
            self.lr = max(ADAPTIVE_LR_MIN, self.lr / ADAPTIVE_LR_FACTOR)
        elif 0.0 < kl < c.desired_kl / 2.0:
            self.lr = min(ADAPTIVE_LR_MAX, self.lr * ADAPTIVE_LR_FACTOR)
        return self.lr

    def state_dict(self) -> dict:
        """The adapted step size (``lr_schedule=adaptive``; else nothing)."""
        return {"learning_rate": self.lr} if self.cfg.lr_schedule == "adaptive" else {}

    def load_state_dict(self, state: dict) -> None:
        """Resumes the adapted step size (a checkpoint of a fixed schedule has none: it
        starts again at ``learning_rate``)."""
        if self.cfg.lr_schedule == "adaptive" and "learning_rate" in state:
            self.lr = float(state["learning_rate"])

    def param_groups(self, policy, params: list) -> list[dict]:
        """One group, or with ``critic_learning_rate`` the critic's parameters
        (``Policy.critic_parameter_names``) in a group of their own at that step size, its
        ``lr_scale`` the ratio to ``learning_rate`` (which annealing keeps)."""
        critic_lr = self.cfg.critic_learning_rate
        if critic_lr is None:
            return super().param_groups(policy, params)
        names = set(policy.critic_parameter_names())
        if not names:
            raise ValueError(
                f"algorithm.critic_learning_rate: policy {type(policy).__name__} has no "
                "parameters of its own critic (Policy.critic_parameter_names); leave it null.")
        critic = {id(p) for n, p in policy.named_parameters() if n in names}
        scale = critic_lr / self.cfg.learning_rate
        return [{"params": [p for p in params if id(p) not in critic]},
                {"params": [p for p in params if id(p) in critic], "lr": critic_lr,
                 "lr_scale": scale}]

    def critic_only(self, iteration: int) -> bool:
        """The first ``critic_warmup`` iterations train the critic alone."""
        return iteration < self.cfg.critic_warmup

    def trained_parameters(self, policy, iteration: int) -> Optional[list[str]]:
        """The names of the only parameters of ``policy`` the update of ``iteration`` trains:
        during the critic warm-up the critic's (``Policy.critic_parameter_names``; every
        other one frozen for the update's length gets no gradient, so Adam leaves it and its
        moments as they are), else None (all of them)."""
        if not self.critic_only(iteration):
            return None
        names = policy.critic_parameter_names()
        if not names:
            raise ValueError(
                f"algorithm.critic_warmup: policy {type(policy).__name__} has no parameters "
                "of its own critic to train alone (Policy.critic_parameter_names); set "
                "algorithm.critic_warmup=0.")
        return names


def ppo_loss(policy, mb: TensorDict, *, clip_coef: float, vf_coef: float, ent_coef: float,
             clip_vloss: bool = False, level: str = "chunk", action_dim: int = 1) -> TensorDict:
    """PPO loss terms for minibatch ``mb`` (keys obs, action, log_prob, value, advantage,
    return; the advantages as they are: normalise them per minibatch before); the policy
    ratio at log-prob ``level`` (:func:`~m2flow.runs.rl.level_log_probs`), each sample's
    advantage on every ratio of it.

    Returns a TensorDict of ``loss_policy``, ``loss_value``, ``loss_entropy`` (sum them to
    train; each a per-sample mean) and diagnostics ``approx_kl``, ``clip_fraction``,
    ``entropy``.
    """
    def value_term(out: TensorDict) -> torch.Tensor:
        value, ret = out[keys.VALUE], mb[keys.RETURN]
        if clip_vloss:
            clipped = mb[keys.VALUE] + (value - mb[keys.VALUE]).clamp(-clip_coef, clip_coef)
            v_loss = 0.5 * torch.max((value - ret) ** 2, (clipped - ret) ** 2).mean()
        else:
            v_loss = 0.5 * ((value - ret) ** 2).mean()
        return vf_coef * v_loss

    return clipped_policy_terms(policy, mb, clip_coef=clip_coef, ent_coef=ent_coef,
                                level=level, action_dim=action_dim, value_term=value_term)
