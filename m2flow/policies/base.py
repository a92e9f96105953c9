"""The one policy interface every model implements.

A policy maps a TensorDict of observations to actions and back to log-probs:

- ``act(batch, deterministic=False)`` reads ``batch["obs"]`` and returns a TensorDict with
  ``action``, ``log_prob`` and ``value`` (used by rollout workers, under ``no_grad``);
- ``evaluate_actions(batch)`` reads ``obs`` and ``action`` and returns ``log_prob``, ``entropy`` and
  ``value`` with gradients (used by the learner);
- ``value(obs)`` returns the critic's estimate (bootstrapping; used by the learner);
- ``bc_loss(batch)`` (optional) is the policy's own supervised loss on expert ``obs`` and
  ``action``, per sample, which behaviour cloning and PPO/GRPO's demonstration term use
  instead of -log pi(action | obs) (a flow-matching policy: flow matching);
- ``observe(batch)`` lets the policy update statistics (e.g. observation normalisation) from a
  training batch; the learner calls it after each update, so log-probs within an update never
  see the statistics change.

Construction: ``make_policy(cfg, env_spec, device)`` calls ``cls(cfg, env_spec,
device=device)`` when ``__init__`` takes a ``device`` -- the policy then builds (or loads) its
weights there, in the dtype that device wants (a VLA's ``dtype=auto``: bf16 on CUDA only) --
and otherwise ``cls(cfg, env_spec)`` followed by ``.to(device)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch
from tensordict import TensorDict
from torch import nn

from m2flow.policies.config import PolicyConfig
from m2flow.registry import Requires

CRITIC_MODULES = frozenset({"critic", "value_head"})


def critic_tensor(name: str) -> bool:
    """Whether state-dict entry ``name`` belongs to a critic: it lies under a module named
    ``critic`` or ``value_head``, at any depth (a LoRA wrapper's prefixes do not matter).

    >>> critic_tensor("value_head.0.weight"), critic_tensor("base.critic.net.2.bias")
    (True, True)
    >>> critic_tensor("actor_mean.weight"), critic_tensor("critic_scale")
    (False, False)
    """
    return bool(CRITIC_MODULES & set(name.split(".")[:-1]))


class PolicyError(ValueError):
    """Bad policy input: unknown name, an env whose observations the policy cannot read."""


class Policy(nn.Module, ABC):
    config_class: type = PolicyConfig
    """Its settings: a dataclass extending :class:`PolicyConfig`, the schema of its policy group
    files (``m2flow.policies.config``); ``cls(cfg, env_spec, ...)`` gets one of these."""
    requires: Optional[Requires] = None
    """The model libraries it imports when built (``m2flow.registry.Requires``), checked at
    start-up; None: none beyond m2flow's own."""

    @abstractmethod
    def act(self, batch: TensorDict, deterministic: bool = False) -> TensorDict:
        """Actions for ``batch["obs"]``: keys ``action`` (B, A), ``log_prob`` (B,), ``value`` (B,)."""

    @abstractmethod
    def evaluate_actions(self, batch: TensorDict) -> TensorDict:
        """For ``batch["obs"]`` and ``batch["action"]``: ``log_prob``, ``entropy``, ``value``."""

    @abstractmethod
    def value(self, obs: TensorDict) -> torch.Tensor:
        """Critic estimate (B,) for a TensorDict of observations."""

    def observe(self, batch: TensorDict) -> None:
        """Updates running statistics from a training batch (default: none)."""

    def bc_loss(self, batch: TensorDict) -> Optional[torch.Tensor]:
        """The policy's own supervised loss (B,) on expert rows (``obs``, ``action``: (B, A),
        or (B, K, A) for a policy with action chunks of K), with gradients; None (the
        default): behaviour cloning and the demonstration term use ``-evaluate_actions``'s
        ``log_prob``. A flow-matching policy, whose log-probs are of its denoising chain and
        not of an action alone, returns its flow-matching loss."""
        return None

    def bc_losses(self, batch: TensorDict
                  ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(:meth:`bc_loss`, the policy's auxiliary loss (B,) on the same rows or None), for
        behaviour cloning. Default: ``(bc_loss(batch), None)``; a policy with its own
        supervised loss and an auxiliary head computes both from one forward pass."""
        return self.bc_loss(batch), None

    def critic_parameter_names(self) -> list[str]:
        """Names of the parameters that compute ``value`` only (the critic's own network or
        a value head on a shared backbone): what trains during PPO's ``critic_warmup``.
        Default: those under a module named ``critic`` or ``value_head`` (at any depth, so
        a LoRA wrapper's prefixes do not matter)."""
        return [n for n, _ in self.named_parameters() if critic_tensor(n)]

    def critic_buffer_names(self) -> list[str]:
        """Names of the buffers only ``value`` reads (a privileged critic's observation
        statistics), by the rule of :meth:`critic_parameter_names`; the others (a shared
        observation normaliser) feed the actor."""
        return [n for n, _ in self.named_buffers() if critic_tensor(n)]
