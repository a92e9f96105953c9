"""An asymmetric critic: an MLP over the simulator state (``("obs", "privileged")``,
``env.privileged_state=true``) that no actor reads, shared by the image policies.

The actor of a policy from pixels must act on what its camera shows, but its critic only
scores states during training, so it may read the simulator's full state: advantages then
come from a value function as good as a state policy's, instead of one the critic must first
learn to read from images (or, on a VLA, from the first action query of a backbone trained
by behaviour cloning). Evaluation never calls it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from tensordict import TensorDict
from torch import nn

from m2flow import keys
from m2flow.policies.base import PolicyError
from m2flow.policies.layers import CRITIC_OUT_GAIN, mlp
from m2flow.policies.normalizer import RunningNorm

PRIVILEGED = "privileged"


def privileged_dim(obs_shapes: dict, setting: str) -> int:
    """The width of the flat privileged vector the env gives; PolicyError naming the fix.
    ``setting``: what asks for it, e.g. ``policy.critic=privileged``."""
    key = keys.leaf(keys.PRIVILEGED)
    if key not in obs_shapes or len(obs_shapes[key]) != 1:
        raise PolicyError(f"{setting} needs a flat ('obs', 'privileged') vector; this "
                          f"env gives {obs_shapes}. Set env.privileged_state=true.")
    return obs_shapes[key][0]


def check_env(env_cfg, setting: str, instead: str) -> None:
    """At start-up: the env config must ask for the privileged state ``setting`` reads
    (e.g. ``policy.critic=privileged``); ``instead``: the other way out."""
    if not getattr(env_cfg, "privileged_state", False):
        raise PolicyError(f"{setting} reads ('obs','privileged'), which the env returns only "
                          f"with env.privileged_state=true; set it, or {instead}.")


class PrivilegedCritic(nn.Module):
    """``value(obs)``: an MLP over the running-normalised privileged vector and, in a
    multi-task env (``num_tasks`` > 1), the one-hot of ``("obs", "task")``; (B,) float32.

    A multi-task env lays its privileged vector out alike across tasks (LIBERO's object
    slots, Meta-World's 39-d state), and nothing in it says which task is being run: LIBERO-
    Object's scenes hold the same kinds of objects whichever one is to be picked. Without the
    task, one value would have to serve every task's success from the same state."""

    def __init__(self, dim: int, hidden: list[int], activation: str = "tanh",
                 num_tasks: int = 0):
        super().__init__()
        self.num_tasks = num_tasks if num_tasks > 1 else 0
        self.norm = RunningNorm(dim)
        self.net = mlp(dim + self.num_tasks, list(hidden), 1, activation, CRITIC_OUT_GAIN)

    def forward(self, obs: TensorDict) -> torch.Tensor:
        x = self.norm(obs[keys.leaf(keys.PRIVILEGED)].float())
        if self.num_tasks:
            task = obs[keys.leaf(keys.TASK)].long().reshape(x.shape[:-1])
            x = torch.cat([x, nn.functional.one_hot(task, self.num_tasks).to(x.dtype)], -1)
        return self.net(x).squeeze(-1)

    def observe(self, batch: TensorDict) -> None:
        self.norm.update(batch[keys.PRIVILEGED].float())


def privileged_critic(env_spec, hidden: list[int], activation: str = "tanh"
                      ) -> PrivilegedCritic:
    """``policy.critic=privileged``'s critic for ``env_spec``: the env's privileged width
    (PolicyError naming the fix where it gives none) and its task count."""
    dim = privileged_dim(env_spec.obs_shapes, "policy.critic=privileged")
    return PrivilegedCritic(dim, hidden, activation, num_tasks=len(env_spec.tasks))


TARGET_MIN_STD = 0.01
"""StateAux's target normalisation never divides by less than this (metres for positions,
unit quaternion components, finger metres): a pose entry that moves by millimetres only (a
distractor resting on the table, the end effector's near-fixed orientation) would otherwise be
stretched to unit variance, and its simulator jitter, which no image shows, would dominate the
loss while the entries that do move (the grasped object, the gripper) are learnt."""


class StateAux(nn.Module):
    """An auxiliary task for an image encoder: predict the running-normalised privileged
    vector from the actor's features (a linear head); ``loss`` is ``coef`` x the per-sample
    mean squared error. The encoder then learns where the objects are from a dense,
    supervised signal instead of from the policy gradient alone; the actor still reads only
    its image and proprio, and evaluation never calls it. The target's std is floored at
    :data:`TARGET_MIN_STD`."""

    def __init__(self, n_features: int, dim: int, coef: float):
        super().__init__()
        self.coef = coef
        self.norm = RunningNorm(dim, min_std=TARGET_MIN_STD)
        self.head = nn.Linear(n_features, dim)

    @staticmethod
    def check(coef: float, env_cfg=None) -> None:
        """At start-up: ``policy.state_aux`` must be >= 0 and finite; with ``env_cfg``, one
        > 0 needs the env to return its target (``env.privileged_state``)."""
        if not (coef >= 0 and math.isfinite(coef)):
            raise PolicyError(f"policy.state_aux={coef}: must be >= 0 (0: off).")
        if coef > 0 and env_cfg is not None:
            check_env(env_cfg, f"policy.state_aux={coef}", "set policy.state_aux=0")

    @classmethod
    def build(cls, n_features: int, obs_shapes: dict, coef: float) -> Optional["StateAux"]:
        """The head over ``n_features`` for the env's privileged vector, or None (coef 0)."""
        if coef <= 0:
            return None
        return cls(n_features, privileged_dim(obs_shapes, f"policy.state_aux={coef}"), coef)

    def loss(self, obs: TensorDict, features: torch.Tensor) -> torch.Tensor:
        target = self.norm(obs[keys.leaf(keys.PRIVILEGED)].float()).detach()
        return self.coef * ((self.head(features) - target) ** 2).mean(-1)

    def observe(self, batch: TensorDict) -> None:
        self.norm.update(batch[keys.PRIVILEGED].float())
