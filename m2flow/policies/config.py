"""The policy config, shared by every registered policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from omegaconf import MISSING


@dataclass
class PolicyConfig:
    """Which model, and its size."""

    name: str = MISSING
    """Registered policy id, e.g. 'mlp'."""
    hidden_sizes: List[int] = field(default_factory=lambda: [256, 256, 256])
    """Widths of the hidden layers of actor and critic (MLP policies)."""
    activation: str = "tanh"
    """Hidden activation: tanh | relu | gelu."""
    normalize_obs: bool = True
    """Normalise state observations by running mean/std (updated by the learner)."""
    init_log_std: float = -0.5
    """Initial log standard deviation of the Gaussian actions (state-independent)."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the policy's constructor."""
