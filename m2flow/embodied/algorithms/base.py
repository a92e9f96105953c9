"""What an embodied algorithm is: a config, a ``prepare`` (advantages and targets on the env
workers' trajectories) and a ``loss`` on minibatches; the learner worker runs the loop.

The generic loop (``m2flow.embodied.workers.learner_worker``): once, Adam on
``algorithm.param_groups(policy, params)``; then per update::

    lr = algorithm.learning_rate(i, num_iterations=n)  # each group's: lr x its lr_scale
    batch, metrics = algorithm.prepare(policy, traj, iteration=i, staleness=s)  # (N, T) -> (B,)
    only algorithm.trained_parameters(policy, i) (None: all) get gradients, while
    for each epoch, for each minibatch mb of a seeded permutation of batch:
        mb = algorithm.minibatch(mb)                 # whole-minibatch statistics
        for each micro-batch of mb:                  # weighted by its share of mb
            terms = algorithm.loss(policy, micro)    # loss_* terms (summed) + diagnostics
        lr = algorithm.adapt_learning_rate(terms of mb)  # None: the step size stays
        clip, optimiser step
    after each epoch: algorithm.stop_early(last terms) ends the loop
    metrics |= algorithm.batch_metrics(batch)

The loop's own sizes (step size, epochs, minibatches, micro-batches, clip, precision) are
the fields of :class:`AlgorithmConfig`, which every algorithm's config has; whatever one
algorithm adds (PPO's critic step size, warm-up and adaptive step size) reaches the loop only
through these hooks, so the learner reads no field of any one algorithm. What an algorithm
learns during a run besides the weights (PPO's adapted step size) is its ``state_dict``, which
the learner's checkpoints carry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from omegaconf import MISSING
from tensordict import TensorDict

from m2flow import keys
from m2flow.pipelines.distributed import SINGLE, DataParallel
from m2flow.runs.learner import frozen_but

PRECISIONS = ("auto", "fp32", "bf16")


class AlgorithmError(ValueError):
    """Bad algorithm input: an unknown name, a value out of range, a dataset that is not one."""


@dataclass
class AlgorithmConfig:
    """The fields the generic learner loop reads; each algorithm's config extends it."""

    name: str = MISSING
    """Registered algorithm name (ppo | grpo | bc | a plugin's)."""
    learning_rate: float = 3e-4
    """Adam step size."""
    anneal_lr: bool = False
    """Decay the step size linearly to 0 over runner.num_iterations (cleanRL's anneal_lr)."""
    update_epochs: int = 4
    """Passes over each iteration's batch."""
    num_minibatches: int = 4
    """Minibatches per epoch (one optimiser step each)."""
    micro_batch_size: Optional[int] = None
    """Samples per forward/backward (gradients accumulate over a minibatch), and per forward
    of ``prepare`` (critic values of the whole batch); None: the whole minibatch (batch) at
    once. Changes memory, not the update."""
    max_grad_norm: Optional[float] = 0.5
    """Global gradient-norm clip (None: none)."""
    precision: str = "auto"
    """auto | fp32 | bf16: the autocast dtype of the learner's forward/backward; parameters
    and optimiser state are fp32 either way. auto: bf16 when the policy's own parameters are
    bf16 (e.g. a VLA built with dtype bfloat16), else fp32."""

    def validate(self) -> None:
        """Raises AlgorithmError (a ValueError) naming the first field out of range."""
        check_field(self, "learning_rate", self.learning_rate > 0, "must be > 0.")
        check_field(self, "update_epochs", self.update_epochs >= 1, "must be >= 1.")
        check_field(self, "num_minibatches", self.num_minibatches >= 1, "must be >= 1.")
        check_field(self, "micro_batch_size",
                    self.micro_batch_size is None or self.micro_batch_size >= 1,
                    "must be >= 1, or null for the whole minibatch.")
        check_field(self, "max_grad_norm", self.max_grad_norm is None or self.max_grad_norm > 0,
                    "must be > 0, or null for no clipping.")
        check_field(self, "precision", self.precision in PRECISIONS,
                    f"use one of {', '.join(PRECISIONS)}.")


def check_field(cfg, field: str, ok: bool, fix: str) -> None:
    """Raises AlgorithmError ``algorithm.<field>=<value>: <fix>`` unless ``ok``: what a
    config's ``validate`` calls for each field it checks (a plugin's config too).

    >>> check_field(AlgorithmConfig(name="x", learning_rate=0.0), "learning_rate", False,
    ...             "must be > 0.")
    Traceback (most recent call last):
    ...
    m2flow.embodied.algorithms.base.AlgorithmError: algorithm.learning_rate=0.0: must be > 0.
    """
    if not ok:
        raise AlgorithmError(f"algorithm.{field}={getattr(cfg, field)!r}: {fix}")


class Algorithm(ABC):
    """One embodied RL (or supervised) algorithm, built by the learner worker as
    ``cls(cfg, action_dim=..., seed=...)``; ``cfg`` is an instance of ``config_class``."""

    config_class: ClassVar[type] = AlgorithmConfig
    """Its config dataclass: the Hydra schema of ``algorithm=<name>``."""
    needs_critic: ClassVar[bool] = False
    """Whether ``loss`` trains the policy's ``value`` (PPO) or ignores it (GRPO, BC)."""
    data_parallel: DataParallel = SINGLE
    """The learner ranks training together (set by the learner worker). With several, each
    ``prepare``s its own trajectories, and ``minibatch`` gets this rank's share of the global
    minibatch: statistics over the whole minibatch or batch (``minibatch``,
    ``batch_metrics``) are taken over every rank with its collectives, called on every rank
    alike (a share may be empty)."""

    def __init__(self, cfg, *, action_dim: int, seed: int):
        cfg.validate()
        self.cfg, self.action_dim, self.seed = cfg, action_dim, seed

    @classmethod
    def reset_group_size(cls, cfg) -> int:
        """Envs per group that reset to one initial state (1: every env its own)."""
        return 1

    @abstractmethod
    def prepare(self, policy, traj: TensorDict, *, iteration: int,
                staleness: int) -> tuple[TensorDict, dict]:
        """The (N, T) trajectory of the env workers -> (the flat training batch (B,) with
        steps whose ``valid`` is False dropped, metrics). ``staleness``: how many updates
        the oldest action lags behind the policy now."""

    def minibatch(self, mb: TensorDict) -> TensorDict:
        """A whole minibatch before it is cut into micro-batches (statistics over the
        minibatch go here, so micro-batching does not change the update)."""
        return mb

    @abstractmethod
    def loss(self, policy, mb: TensorDict) -> TensorDict:
        """``loss_*`` terms (the learner sums them) and diagnostics, batch_size []; each a
        per-sample mean, so micro-batches weighted by their share add up to the minibatch."""

    def stop_early(self, terms: dict) -> bool:
        """After an epoch, on its last minibatch's terms: True ends the update."""
        return False

    def adapt_learning_rate(self, terms: dict) -> Optional[float]:
        """Before each minibatch's optimiser step, on its terms (micro-batches summed; with
        several ranks, the global minibatch's, the same on every rank): a new step size
        (groups with an ``lr_scale`` get that multiple of it; it holds until the next one or
        the next update's :meth:`learning_rate`), or None to keep the current one. Default:
        None. PPO's ``lr_schedule=adaptive`` returns rsl-rl's KL-adapted step size."""
        return None

    def state_dict(self) -> dict:
        """What the algorithm has learned during the run besides the weights (PPO's adapted
        step size), for checkpoints: plain Python values. Default: ``{}``."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict` (``{}``: a checkpoint without it; nothing changes).
        Default: nothing to restore."""

    def param_groups(self, policy, params: list) -> list[dict]:
        """The optimiser's parameter groups over ``params`` (every parameter of ``policy``,
        frozen ones too; sharded, the shards), built once with the learner's optimiser. A
        group may carry ``lr`` (its own step size) and ``lr_scale`` (its step size's ratio to
        :meth:`learning_rate`, which the learner applies at every update, so a schedule keeps
        the ratio). Default: one group of them all at :meth:`learning_rate`. An algorithm
        overrides it to step some parameters at a size of their own (PPO: the critic's at
        ``critic_learning_rate``)."""
        return [{"params": list(params)}]

    def learning_rate(self, iteration: int, *, num_iterations: int) -> float:
        """The step size of the update of ``iteration`` in a run of ``num_iterations``
        (groups with an ``lr_scale`` get that multiple of it), set at the start of the
        update. A fixed or annealed schedule is a function of these two alone; an adaptive
        one's (:meth:`adapt_learning_rate`) depends on the algorithm's state too, which
        checkpoints carry (:meth:`state_dict`): either way a resumed run takes the steps the
        uninterrupted one would have. Default: ``learning_rate``, or with ``anneal_lr``
        decayed linearly from it towards 0 at ``num_iterations`` (cleanRL's anneal_lr)."""
        if not self.cfg.anneal_lr:
            return self.cfg.learning_rate
        return self.cfg.learning_rate * (1.0 - iteration / max(1, num_iterations))

    def critic_only(self, iteration: int) -> bool:
        """Whether the update of ``iteration`` trains the critic alone (the policy's other
        parameters frozen; the learner reports ``loss/critic_only``): PPO's
        ``critic_warmup``."""
        return False

    def trained_parameters(self, policy, iteration: int) -> Optional[list[str]]:
        """The names of the only parameters of ``policy`` the update of ``iteration`` trains
        (None: all of them). The learner freezes every other one for the update's length:
        they get no gradient, so the optimiser leaves them (and their moments) as they are.
        Default: while :meth:`critic_only`, the critic's (``Policy.critic_parameter_names``),
        a ValueError when the policy has none (else nothing would train)."""
        if not self.critic_only(iteration):
            return None
        names = policy.critic_parameter_names()
        if not names:
            raise ValueError(
                f"algorithm={self.cfg.name}: the update of iteration {iteration} trains the "
                f"critic alone (Algorithm.critic_only), but policy {type(policy).__name__} has "
                "no parameters of its own critic (Policy.critic_parameter_names).")
        return names

    def train(self, policy, batch: TensorDict, trainer, *, iteration: int, seed: int) -> dict:
        """The update's optimiser steps on the prepared ``batch`` (B,) with ``trainer`` (a
        :class:`~m2flow.runs.learner.Trainer` over ``policy``); its metrics (``loss/*``).
        Default, the on-policy loop (PPO, GRPO, BC): ``update_epochs`` passes of
        ``num_minibatches`` minibatches of :meth:`loss`, with the hooks above (the minibatch
        statistics, early stop, the adaptive step size; only :meth:`trained_parameters`
        train). An off-policy algorithm (SAC) replaces it: its steps sample a replay buffer
        that ``prepare`` filled."""
        c = self.cfg
        with frozen_but(policy, self.trained_parameters(policy, iteration)):
            terms = trainer.run_epochs(
                batch, lambda mb: self.loss(policy, mb), epochs=c.update_epochs,
                num_minibatches=c.num_minibatches, micro_batch_size=c.micro_batch_size,
                seed=seed, iteration=iteration, minibatch=self.minibatch,
                stop_early=self.stop_early, adapt_lr=self.adapt_learning_rate,
            )
        metrics = {f"loss/{k}": v for k, v in terms.items()}
        if self.critic_only(iteration):
            metrics["loss/critic_only"] = 1.0
        metrics["loss/total"] = sum(v for k, v in metrics.items() if k.startswith("loss/loss_"))
        metrics.update(self.batch_metrics(batch))
        return metrics

    def resume_note(self) -> str:
        """After a checkpoint's state was loaded: one line on the algorithm state the resumed
        run continues with, for the resume announcement ('': nothing to say)."""
        return ""

    def batch_metrics(self, batch: TensorDict) -> dict:
        """Metrics of the whole prepared batch after the update (named with their prefix)."""
        return {}


@torch.no_grad()
def batched_values(policy, obs: TensorDict, micro_batch_size: Optional[int]) -> torch.Tensor:
    """``policy.value`` of ``obs`` (B,) in forwards of at most ``micro_batch_size`` rows (None:
    one forward), as fp32 (B,). ``prepare`` runs over every step of an iteration at once, N*T
    observations: at 7B with images one forward of them all does not fit (the learner's
    ``algorithm.micro_batch_size`` bounds the training forwards the same way).

    >>> class Sum:
    ...     def value(self, obs):
    ...         print(obs.shape[0], end=" ")
    ...         return obs["x"].sum(-1)
    >>> batched_values(Sum(), TensorDict({"x": torch.ones(5, 2)}, [5]), 2)
    2 2 1 tensor([2., 2., 2., 2., 2.])
    """
    n = obs.shape[0]
    k = n if micro_batch_size is None else micro_batch_size
    if n <= k:
        return policy.value(obs).float()
    # float(): under bf16 autocast the critic's output is bf16; returns stay fp32
    return torch.cat([policy.value(obs[i:i + k]).float() for i in range(0, n, k)])


def flatten_valid(traj: TensorDict) -> TensorDict:
    """(N, T) -> (N*T,), without the steps whose ``valid`` is False (a lost episode's)."""
    flat = traj.reshape(-1)  # (N*T,)
    if keys.VALID in flat.keys():
        flat = flat[flat[keys.VALID]]
    return flat
