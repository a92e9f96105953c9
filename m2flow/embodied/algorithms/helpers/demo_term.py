"""A behaviour-cloning term on demonstrations inside an RL loss: the hand-off from BC to RL.

RL warm-started from a cloned policy (``init_from``) moves it on advantages that a new critic
estimates from a handful of episodes; nothing in PPO's or GRPO's loss remembers what the
demonstrations taught, so early noisy updates can walk the policy off it for good. This term
adds, to every minibatch's loss,

    demo_coef * demo_decay ** iteration * (-log pi(expert action | expert obs))

averaged over ``demo_batch_size`` demonstration steps drawn afresh for each minibatch (DAPG,
Rajeswaran et al. 2018: the same term with the same geometric decay, there weighted by
advantages; "PPO + BC" in the offline-to-online literature). The demonstrations are read as
``algorithm=bc`` reads them (:mod:`m2flow.embodied.algorithms.helpers.expert_data`: an
m2flow-demos .h5 file or a .pt batch, action chunks and action tokens for the policy at hand).

The term is per minibatch, so each micro-batch of a minibatch adds its share of it (the
learner weights micro-batches by their share, so the sum is the term once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.algorithms.base import check_field
from m2flow.embodied.algorithms.helpers.expert_data import ExpertData
from m2flow.runs import seeding


@dataclass
class DemoTermConfig:
    """The fields of the demonstration term (PPO's and GRPO's configs have them)."""

    demo_coef: float = 0.0
    """Weight of the demonstrations' negative log-likelihood in each minibatch's loss at
    iteration 0 (0: no term). 0.1-1 keeps a cloned policy near its demonstrations while
    the critic catches up."""
    demo_decay: float = 1.0
    """The weight at iteration i is ``demo_coef * demo_decay ** i`` (DAPG's decay; 1: constant;
    0.95 halves it every ~14 iterations)."""
    demo_dataset: Optional[str] = None
    """The demonstrations: an .h5 file written by m2flow-demos or a .pt batch, as
    ``algorithm=bc`` reads ``algorithm.dataset`` (usually the same file the BC run used)."""
    demo_num: Optional[int] = None
    """With an .h5 dataset: its first N episodes (None: all)."""
    demo_noop_threshold: float = 0.0
    """With an .h5 dataset: drop no-op steps as ``algorithm=bc``'s ``noop_threshold``."""
    demo_batch_size: int = 256
    """Demonstration steps per minibatch."""

    def validate_demo_term(self) -> None:
        check_field(self, "demo_coef", self.demo_coef >= 0, "must be >= 0 (0: no term).")
        check_field(self, "demo_decay", 0 < self.demo_decay <= 1, "must be in (0, 1].")
        check_field(self, "demo_batch_size", self.demo_batch_size >= 1, "must be >= 1.")
        check_field(self, "demo_dataset", self.demo_coef == 0 or self.demo_dataset is not None,
                    f"algorithm.demo_coef={self.demo_coef} needs the demonstrations: set "
                    "algorithm.demo_dataset=<m2flow-demos .h5 file> (or demo_coef=0).")


class DemoTerm:
    """The term of a :class:`DemoTermConfig` for one algorithm: call :meth:`start` in
    ``prepare`` (per iteration), :meth:`next_minibatch` in ``train`` as each minibatch
    begins, and add :meth:`terms` to ``loss``'s."""

    def __init__(self, cfg: DemoTermConfig, *, action_dim: int, seed: int):
        self.cfg, self.seed = cfg, seed
        self.data = (ExpertData(cfg.demo_dataset, action_dim, num_demos=cfg.demo_num,
                                noop_threshold=cfg.demo_noop_threshold, field="demo_dataset",
                                options=("demo_num", "demo_noop_threshold"))
                     if cfg.demo_coef > 0 else None)
        self.weight = 0.0
        self.batch: Optional[TensorDict] = None
        self.gen: Optional[torch.Generator] = None
        self.pending = False

    @property
    def active(self) -> bool:
        return self.data is not None

    def start(self, iteration: int) -> None:
        """The weight and the seeded draws of ``iteration``'s update."""
        if not self.active:
            return
        self.weight = self.cfg.demo_coef * self.cfg.demo_decay ** iteration
        self.gen = torch.Generator().manual_seed(
            seeding.derive(self.seed, seeding.DEMO, iteration, 0)[0])

    def next_minibatch(self) -> None:
        """A new minibatch begins: its first :meth:`terms` draws new rows (its micro-batches
        share them)."""
        self.pending = True

    def terms(self, policy, device) -> dict:
        """``loss_demo``: ``weight * -mean log pi(expert action | obs)`` over this minibatch's
        demonstration rows (or the mean of the policy's own ``Policy.bc_loss``), and
        ``demo_nll`` (the mean without the weight); ``{}`` without the term."""
        if not self.active:
            return {}
        if self.pending or self.batch is None:
            self.batch = self.data.sample(policy, self.cfg.demo_batch_size, self.gen).to(device)
            self.pending = False
        own = policy.bc_loss(self.batch)  # a flow policy's flow matching, else the NLL
        if own is not None:
            nll = own.mean()
        else:
            nll = -policy.evaluate_actions(self.batch)[keys.LOG_PROB].mean()
        return {"loss_demo": self.weight * nll, "demo_nll": nll.detach()}
