"""What an embodied algorithm is: a config, a ``prepare`` (advantages and targets on the env
workers' trajectories) and a ``train`` that runs its own update loop; the learner worker
calls them, and a handful of hooks besides, once per update.

The learner worker (``m2flow.embodied.workers.learner_worker``): once, Adam on
``algorithm.param_groups(policy, params)``; then per update::

    lr = algorithm.learning_rate(i, num_iterations=n)  # each group's: lr x its lr_scale
    batch, metrics = algorithm.prepare(policy, traj, iteration=i, staleness=s)  # (N, T) -> (B,)
    metrics |= algorithm.train(policy, batch, trainer, iteration=i, seed=seed)
    policy.observe(batch)  # during algorithm.critic_only(i): the critic's statistics alone

``train`` is the algorithm's loop, read top to bottom in its module (rsl-rl's and cleanRL's
way): for PPO, for each epoch, for each minibatch of ``trainer.minibatches`` (a seeded
permutation), its whole-minibatch statistics, ``trainer.gradients`` (micro-batches under
autocast, summed over the ranks), its step-size rule, ``trainer.step``; its early stop after
the epoch. The pieces it calls are :mod:`m2flow.runs.learner`'s, and :func:`loss_metrics`
names what it reports.

The loop's own sizes (step size, epochs, minibatches, micro-batches, clip, precision) are
the fields of :class:`AlgorithmConfig`, which every algorithm's config has; the learner
worker reads no other field, so what one algorithm adds (PPO's critic step size, warm-up and
adaptive step size) reaches it only through the hooks. What an algorithm learns during a run
besides the weights (PPO's adapted step size) is its ``state_dict``, which the learner's
checkpoints carry.
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
from m2flow.runs.learner import PRECISIONS  # the Trainer's: one list of what it can run


class AlgorithmError(ValueError):
    """Bad algorithm input: an unknown name, a value out of range, a dataset that is not one."""


@dataclass
class AlgorithmConfig:
    """The fields the learner worker and the update loops read; each algorithm's config
    extends it."""

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
    """auto | fp32 | bf16 | fp16: the autocast dtype of the learner's forward/backward;
    parameters and optimiser state are fp32 either way. auto: bf16 (fp16) when the policy's
    own parameters are bf16 (fp16; e.g. a VLA built with dtype bfloat16), else fp32. fp16
    adds a gradient scaler, which one learner rank alone may own."""

    def update_samples(self, collected: int) -> tuple[int, str]:
        """(the samples one update trains on, where that number comes from, for a config
        error's line): by default those the iteration collected (``collected``)."""
        return collected, "env.num_envs x env workers x runner.rollout_steps"

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
    ``cls(cfg, action_dim=..., seed=...)``; ``cfg`` is an instance of ``config_class``. The
    learner worker calls ``prepare`` and ``train`` each update, and the hooks below."""

    config_class: ClassVar[type] = AlgorithmConfig
    """Its config dataclass: the Hydra schema of ``algorithm=<name>``."""
    needs_critic: ClassVar[bool] = False
    """Whether its loss trains the policy's ``value`` (PPO) or ignores it (GRPO, BC)."""
    learns_from_rewards: ClassVar[bool] = True
    """Whether the env's rewards are what it learns from (False: BC, which fits a dataset's
    actions), so that a batch of equal rewards is a run that cannot learn
    (``runner.warn_no_signal_iterations``)."""
    data_parallel: DataParallel = SINGLE
    """The learner ranks training together (set by the learner worker). With several, each
    ``prepare``s its own trajectories and its ``train`` sees this rank's share of each global
    minibatch: statistics over a whole minibatch or batch (advantage normalisation, explained
    variance) are taken over every rank with its collectives, called on every rank alike (a
    share may be empty)."""

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

    @abstractmethod
    def train(self, policy, batch: TensorDict, trainer, *, iteration: int, seed: int) -> dict:
        """The update's optimiser steps on the prepared ``batch`` (B,) with ``trainer`` (a
        :class:`~m2flow.runs.learner.Trainer` over ``policy``, its step size already set by
        :meth:`learning_rate`): the algorithm's own loop over the Trainer's pieces
        (``minibatches``, ``gradients``, ``step``; ``minibatch_generator(seed, iteration)``
        for its order). Returns its metrics (``loss/*``: :func:`loss_metrics`). Called when
        the global batch has rows."""

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
        (groups with an ``lr_scale`` get that multiple of it), set before :meth:`train`. A
        fixed or annealed schedule is a function of these two alone; an adaptive one (PPO's
        ``lr_schedule=adaptive``, which its ``train`` moves minibatch by minibatch) depends
        on the algorithm's state too, which checkpoints carry (:meth:`state_dict`): either
        way a resumed run takes the steps the uninterrupted one would have. Default:
        ``learning_rate``, or with ``anneal_lr`` decayed linearly from it towards 0 at
        ``num_iterations`` (cleanRL's anneal_lr)."""
        if not self.cfg.anneal_lr:
            return self.cfg.learning_rate
        return self.cfg.learning_rate * (1.0 - iteration / max(1, num_iterations))

    def critic_only(self, iteration: int) -> bool:
        """Whether the update of ``iteration`` trains the critic alone (PPO's
        ``critic_warmup``): the learner then updates only the critic's running statistics
        (``Policy.critic_buffer_names``). Default: False."""
        return False

    def resume_note(self) -> str:
        """After a checkpoint's state was loaded: one line on the algorithm state the resumed
        run continues with, for the resume announcement ('': nothing to say)."""
        return ""


def loss_metrics(terms: dict, *, early_stop: bool, critic_only: bool = False) -> dict:
    """What an on-policy update reports: each of its minibatches' mean ``terms`` as
    ``loss/<term>``, ``loss/early_stop`` (0/1), ``loss/critic_only`` (1, only when it trained
    the critic alone) and ``loss/total``, the sum of the ``loss_*`` terms in their order.

    >>> loss_metrics({"loss_a": 0.5, "kl": 0.1, "loss_b": 0.25}, early_stop=True)["loss/total"]
    0.75
    """
    metrics = {f"loss/{k}": v for k, v in terms.items()}
    metrics["loss/early_stop"] = float(early_stop)
    if critic_only:
        metrics["loss/critic_only"] = 1.0
    metrics["loss/total"] = sum(v for k, v in metrics.items() if k.startswith("loss/loss_"))
    return metrics


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
