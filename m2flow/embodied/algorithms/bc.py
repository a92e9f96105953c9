"""Behaviour cloning: a supervised loss on expert actions from a dataset, for warm starts.

The env collection still runs every iteration (its success is logged, so the log shows the
cloned policy's progress), but ``prepare`` ignores the trajectory and returns a seeded sample
of the dataset instead.

The dataset is a ``.pt`` file written by ``torch.save(td, path)`` of a TensorDict with batch
dims (N, T) or (B,), holding what the policy reads and the expert's actions:

- ``obs``: the observations, as the env gives them (e.g. ``("obs", "state")`` (..., D));
- ``action``: the expert's action (..., A) (token policies, e.g. VLAs, read
  ``action_tokens`` in ``evaluate_actions`` too);
- ``valid`` (optional, bool): steps to keep.

Losses (``algorithm.loss``):

- ``nll`` (default, every policy): -log pi(expert action | obs) through
  ``policy.evaluate_actions``; for a Gaussian policy it also fits the std.
- ``mse``: squared error (summed over action dims) of the policy's deterministic action
  ``policy.act(batch, deterministic=True)["action"]``; needs a policy whose deterministic action
  is differentiable (the Gaussian ``mlp`` and ``cnn``: their mean), not the token VLAs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmError, _check
from m2flow.runs import seeding

BC_LOSSES = ("nll", "mse")


@dataclass
class BCConfig(AlgorithmConfig):
    """Behaviour-cloning hyper-parameters."""

    name: str = "bc"
    """Registered algorithm name."""
    dataset: str = MISSING
    """Path of a .pt file: a TensorDict (N, T) or (B,) with obs, action (and optionally valid)."""
    loss: str = "nll"
    """nll (-log-prob of the expert action; any policy) | mse (deterministic action's squared
    error; Gaussian policies)."""
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

    def validate(self) -> None:
        super().validate()
        _check(self, "loss", self.loss in BC_LOSSES, f"use one of {', '.join(BC_LOSSES)}.")
        _check(self, "batch_size", self.batch_size >= 1, "must be >= 1.")


class BC(Algorithm):
    """``algorithm=bc``: fits the policy to the expert actions of ``algorithm.dataset``."""

    config_class = BCConfig
    needs_critic = False

    def __init__(self, cfg: BCConfig, *, action_dim: int, seed: int):
        super().__init__(cfg, action_dim=action_dim, seed=seed)
        self.data = load_dataset(cfg.dataset, action_dim)  # (M,)

    @torch.no_grad()
    def prepare(self, policy, traj: TensorDict, *, iteration: int,
                staleness: int) -> tuple[TensorDict, dict]:
        """A sample of the dataset (seeded by the iteration); the trajectory is not used."""
        m, n = self.data.shape[0], self.cfg.batch_size
        gen = torch.Generator().manual_seed(
            seeding.derive(self.seed, seeding.LEARN, iteration, 0, n=2)[1])
        if n <= m:
            idx = torch.randperm(m, generator=gen)[:n]
        else:  # a dataset smaller than a batch: with replacement
            idx = torch.randint(m, (n,), generator=gen)
        return self.data[idx].to(traj.device), {}

    def loss(self, policy, mb: TensorDict) -> TensorDict:
        if self.cfg.loss == "mse":
            action = policy.act(mb, deterministic=True)[keys.ACTION]
            if not action.requires_grad:
                raise AlgorithmError(
                    f"algorithm.loss='mse' needs a policy whose deterministic action is "
                    f"differentiable; {type(policy).__name__}'s is not. Use algorithm.loss=nll."
                )
            err = ((action - mb[keys.ACTION]) ** 2).reshape(mb.shape[0], -1).sum(-1)
            return TensorDict({"loss_bc": err.mean()}, batch_size=[])
        out = policy.evaluate_actions(mb)
        return TensorDict({"loss_bc": -out[keys.LOG_PROB].mean(),
                           "entropy": out[keys.ENTROPY].mean().detach()}, batch_size=[])


def load_dataset(path: str, action_dim: int) -> TensorDict:
    """The dataset at ``path`` as a flat (M,) TensorDict of its valid steps, on the CPU; a
    missing or malformed file is one AlgorithmError naming algorithm.dataset."""
    where = f"algorithm.dataset={path!r}"
    if not Path(path).expanduser().is_file():
        raise AlgorithmError(
            f"{where}: no such file; point it at a .pt file saved with "
            "torch.save(TensorDict({'obs': ..., 'action': ...}, batch_size), path).")
    try:
        # a TensorDict is a pickled object, not plain tensors: the file must be trusted
        data = torch.load(Path(path).expanduser(), map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise AlgorithmError(f"{where}: cannot be read by torch.load ({type(e).__name__}: "
                             f"{e}); save the dataset with torch.save(tensordict, path).") from None
    if not isinstance(data, TensorDict):
        raise AlgorithmError(f"{where} holds a {type(data).__name__}, not a TensorDict; save "
                             "TensorDict({'obs': ..., 'action': ...}, batch_size) instead.")
    missing = [k for k in (keys.OBS, keys.ACTION) if k not in data.keys()]
    if missing or data.batch_dims not in (1, 2):
        raise AlgorithmError(f"{where} has keys {sorted(data.keys())} and batch dims "
                             f"{list(data.batch_size)}; it needs 'obs' and 'action' with batch "
                             "dims (N, T) or (B,).")
    flat = data.reshape(-1)  # (M,)
    if flat[keys.ACTION].shape[-1] != action_dim:
        raise AlgorithmError(f"{where}: actions have {flat[keys.ACTION].shape[-1]} dims, the "
                             f"env's have {action_dim}; record the dataset on this env.")
    if keys.VALID in flat.keys():
        flat = flat[flat[keys.VALID].bool()]
    if flat.shape[0] == 0:
        raise AlgorithmError(f"{where} holds no valid steps.")
    return flat


ALGORITHM = BC  # what the registry finds under "bc"
