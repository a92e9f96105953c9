"""The settings every policy has; each registered policy's own dataclass extends them.

A policy class names its settings class as ``config_class`` (``Policy``'s default: this
base); the registry stores it as Hydra schema ``policy/<name>_schema``, and a policy group
file starts with ``defaults: [<name>_schema, _self_]``, so every key of it is checked
against that class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from omegaconf import MISSING


@dataclass
class PolicyConfig:
    """Which model."""

    name: str = MISSING
    """Registered policy id, e.g. 'mlp'."""


@dataclass
class MLPHeadsConfig(PolicyConfig):
    """The settings of policies whose actor and critic heads are MLPs (mlp, cnn, sac_*)."""

    hidden_sizes: List[int] = field(default_factory=lambda: [256, 256, 256])
    """Widths of the hidden layers of actor and critic."""
    activation: str = "tanh"
    """Hidden activation: tanh | relu | gelu."""
    normalize_obs: bool = True
    """Normalise state observations by running mean/std (updated by the learner)."""
    hold_obs_norm: bool = False
    """Keep those statistics as they start (a warm start's: ``init_from``) instead of updating
    them from every batch: the actor's inputs keep the scale it was trained on, where RL's
    states would otherwise move them away from the demonstrations' during fine-tuning."""
