"""Behaviour cloning: a supervised loss on expert actions from a dataset, for warm starts.

The env collection still runs every iteration (its success is logged, so the log shows the
cloned policy's progress), but ``prepare`` ignores the trajectory and returns a seeded sample
of the dataset instead.

Datasets (``algorithm.dataset``), action chunks and action tokens: see
:mod:`m2flow.embodied.algorithms.helpers.expert_data`.

Losses (``algorithm.loss``):

- ``nll`` (default, every policy): -log pi(expert action | obs) through
  ``policy.evaluate_actions``; for a Gaussian policy it also fits the std. A policy with a
  supervised loss of its own (``Policy.bc_loss``: ``flow_mlp``'s flow matching, whose
  log-probs are of a denoising chain and not of an action) is trained on that instead.
- ``mse``: squared error (summed over action dims) of the policy's deterministic action
  ``policy.act(batch, deterministic=True)["action"]``; needs a policy whose deterministic action
  is differentiable (the Gaussian ``mlp`` and ``cnn``: their mean), not the token VLAs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import MISSING
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.algorithms.base import (
    Algorithm, AlgorithmConfig, AlgorithmError, check_field, loss_metrics)
from m2flow.embodied.algorithms.helpers.augment import shift_images
from m2flow.embodied.algorithms.helpers.expert_data import ExpertData, action_bins
from m2flow.runs import seeding
from m2flow.runs.learner import Means, minibatch_generator

BC_LOSSES = ("nll", "mse")


@dataclass
class BCConfig(AlgorithmConfig):
    """Behaviour-cloning hyper-parameters."""

    name: str = "bc"
    """Registered algorithm name."""
    dataset: str = MISSING
    """Path of the demonstrations: an .h5 file written by m2flow-demos, or a .pt file (a
    TensorDict (N, T) or (B,) with obs, action and optionally valid)."""
    num_demos: Optional[int] = None
    """With an .h5 dataset: train on its first N episodes (None: all)."""
    loss: str = "nll"
    """nll (-log-prob of the expert action, or the policy's own loss where it has one:
    flow_mlp's flow matching; any policy) | mse (deterministic action's squared error;
    Gaussian policies)."""
    batch_size: int = 256
    """Dataset samples per iteration (without replacement while the dataset has enough)."""
    learning_rate: float = 1e-3
    """Adam step size."""
    update_epochs: int = 1
    """Passes over each iteration's sample."""
    num_minibatches: int = 1
    """Minibatches per epoch."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip."""
    target_noise: float = 0.0
    """Std of Gaussian noise added to every sampled expert action before it becomes a
    target, drawn afresh for each iteration's sample: in the policy's normalised action space
    for a token policy (the VLAs: [-1, 1] before the 256 bins; the tiny presets' actions
    are the env's), else in the env's action units. For a token policy this is label
    smoothing over neighbouring bins: the NLL's expectation is the cross-entropy to the
    expert's bin blurred by that Gaussian, so the cloned per-token distribution is one smooth
    bump around the expert action, and sampling it at temperature 1 tries actions near the
    cloned one, which RL from this warm start needs. Without it the cloned distribution is a
    sharp peak with a flat tail: sampled at temperature 1 the tail's far bins end episodes;
    at 0.5 the samples are the argmax's to within a bin or two (the VLA recipe rows of
    docs/results.md)."""

    noop_threshold: float = 0.0
    """With an .h5 dataset: drop the demonstration steps that do nothing (OpenVLA's no-op
    filter for LIBERO): the arm's part of the action (every dim but the last, the gripper's)
    has an L2 norm below this and the gripper's command equals the step before's. A motion
    planner starts each segment from rest, so its first actions are ~0; a memoryless policy
    cloned on them predicts ~0 at rest, and the robot never starts moving (PickCube's
    planner demos: 0.00 success at 100 steps with them). 0: keep every step."""

    image_shift: int = 0
    """Random-shift augmentation of the sampled images (DrQ): every image observation of each
    iteration's sample padded by this many pixels (edges repeated) and cropped back at a random
    offset, drawn afresh each iteration; 0: none. 4 suits 64-128 px frames (DrQ's 4 at 84 px).
    Keeps a small image encoder from memorising a few thousand expert frames pixel by pixel
    (m2flow.embodied.algorithms.helpers.augment)."""

    aux_pretrain_iterations: int = 0
    """The first N iterations train the policy's auxiliary loss alone (``policy.state_aux``:
    the simulator state predicted from what the policy sees), the expert actions' loss logged
    but not trained; cloning starts after them, the auxiliary loss still on. As a VLA starts
    from a vision-language model that already grounds objects in its image, a model built
    from random weights first learns where the objects are before it learns what to do about
    them; cloning alone, whose loss a few thousand frames can lower by memorising them, may
    never route that into the action tokens. 0: clone from the start."""

    def update_samples(self, collected: int) -> tuple[int, str]:
        """An update trains on ``batch_size`` dataset rows, whatever the env collected (the
        collection only logs the cloned policy's success)."""
        return self.batch_size, "algorithm.batch_size, drawn from the dataset"

    def validate(self) -> None:
        super().validate()
        check_field(self, "loss", self.loss in BC_LOSSES, f"use one of {', '.join(BC_LOSSES)}.")
        check_field(self, "image_shift", self.image_shift >= 0,
                    "must be >= 0 (pixels of random shift; 0: no augmentation).")
        check_field(self, "target_noise", self.target_noise >= 0,
                    "must be >= 0 (the std of the noise on the expert actions; 0: none).")
        check_field(self, "batch_size", self.batch_size >= 1, "must be >= 1.")
        check_field(self, "noop_threshold", self.noop_threshold >= 0,
                    "must be >= 0 (0: keep every step).")
        check_field(self, "num_demos", self.num_demos is None or self.num_demos >= 1,
                    "must be >= 1, or null for every episode of the dataset.")
        check_field(self, "aux_pretrain_iterations", self.aux_pretrain_iterations >= 0,
                    "must be >= 0 (0: clone from the first iteration).")


class BC(Algorithm):
    """``algorithm=bc``: fits the policy to the expert actions of ``algorithm.dataset``."""

    config_class = BCConfig
    needs_critic = False
    learns_from_rewards = False

    def __init__(self, cfg: BCConfig, *, action_dim: int, seed: int):
        super().__init__(cfg, action_dim=action_dim, seed=seed)
        self.expert = ExpertData(cfg.dataset, action_dim, num_demos=cfg.num_demos,
                                 noop_threshold=cfg.noop_threshold)
        self.aux_only = False  # this iteration trains the auxiliary loss alone

    @torch.no_grad()
    def prepare(self, policy, traj: TensorDict, *, iteration: int,
                staleness: int) -> tuple[TensorDict, dict]:
        """A sample of the dataset (seeded by the iteration); the trajectory is not used."""
        gen = torch.Generator().manual_seed(
            seeding.derive(self.seed, seeding.LEARN, iteration, 0, n=2)[1])
        batch = self.expert.sample(policy, self.cfg.batch_size, gen)
        if self.cfg.target_noise > 0:
            batch = self._noisy(policy, batch, gen)
        if self.cfg.image_shift > 0:
            batch[keys.OBS] = shift_images(batch[keys.OBS], self.cfg.image_shift, gen)
        return batch.to(traj.device), {}

    def _noisy(self, policy, batch: TensorDict, gen: torch.Generator) -> TensorDict:
        """``batch`` with its targets moved by the noise of ``target_noise`` (its action
        tokens, for a token policy; else its actions)."""
        batch = batch.clone(recurse=False)
        action = batch[keys.ACTION]
        eps = torch.randn(action.shape, generator=gen) * self.cfg.target_noise
        if keys.ACTION_TOKENS in batch.keys():
            batch[keys.ACTION_TOKENS] = action_bins(policy, action, noise=eps)
        else:
            batch[keys.ACTION] = action + eps
        return batch

    def train(self, policy, batch: TensorDict, trainer, *, iteration: int, seed: int) -> dict:
        """``update_epochs`` passes over the sample in ``num_minibatches`` minibatches of a
        seeded permutation, one optimiser step each on :meth:`loss`. Reports the
        minibatches' mean terms (``loss/early_stop`` always 0)."""
        c = self.cfg
        self.aux_only = iteration < c.aux_pretrain_iterations
        gen, means = minibatch_generator(seed, iteration), Means()
        for _ in range(c.update_epochs):
            for mb in trainer.minibatches(batch, c.num_minibatches, gen):
                terms = trainer.gradients(mb, lambda m: self.loss(policy, m),
                                          micro_batch_size=c.micro_batch_size)
                terms["grad_norm"] = trainer.step()
                means.add(terms)
        return loss_metrics(means.means(), early_stop=False)

    def loss(self, policy, mb: TensorDict) -> TensorDict:
        """The supervised loss of ``algorithm.loss`` on minibatch ``mb`` (see the module
        docstring)."""
        if self.cfg.loss == "mse":
            action = policy.act(mb, deterministic=True)[keys.ACTION]
            if not action.requires_grad:
                raise AlgorithmError(
                    f"algorithm.loss='mse' needs a policy whose deterministic action is "
                    f"differentiable; {type(policy).__name__}'s is not. Use algorithm.loss=nll."
                )
            err = ((action - mb[keys.ACTION]) ** 2).reshape(mb.shape[0], -1).sum(-1)
            return TensorDict({"loss_bc": err.mean()}, batch_size=[])
        own, aux = policy.bc_losses(mb)
        if own is not None:  # the policy's own supervised loss (flow matching)
            terms = {"loss_bc": own.mean()}
        else:
            out = policy.evaluate_actions(mb)
            terms = {"loss_bc": -out[keys.LOG_PROB].mean(),
                     "entropy": out[keys.ENTROPY].mean().detach()}
            aux = out.get(keys.AUX_LOSS, None)  # the policy's own, as PPO and GRPO add it
        if aux is not None:
            terms["loss_aux"] = aux.mean()
        if self.aux_only:
            if "loss_aux" not in terms:
                raise AlgorithmError(
                    f"algorithm.aux_pretrain_iterations={self.cfg.aux_pretrain_iterations} "
                    f"trains the policy's auxiliary loss, but {type(policy).__name__} has none "
                    "on; set policy.state_aux > 0, or algorithm.aux_pretrain_iterations=0.")
            terms["bc_nll"] = terms.pop("loss_bc").detach()  # logged, not trained
        return TensorDict(terms, batch_size=[])
