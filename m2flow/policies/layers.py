"""The layers every Gaussian actor-critic builds from: activations, PPO's orthogonal
initialisation, and MLPs of them (shared by ``mlp.py``, ``cnn.py`` and ``critics.py``)."""

from __future__ import annotations

import numpy as np
from torch import nn

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU, "elu": nn.ELU}
ACTOR_OUT_GAIN = 0.01 * np.sqrt(2)  # small initial means: start near zero action
CRITIC_OUT_GAIN = 1.0


def orthogonal_linear(n_in: int, n_out: int, gain: float = np.sqrt(2)) -> nn.Linear:
    """A linear layer with orthogonal weights of ``gain`` and zero bias (the usual PPO init)."""
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def mlp(n_in: int, hidden: list[int], n_out: int, activation: str, out_gain: float) -> nn.Sequential:
    layers, width = [], n_in
    for h in hidden:
        layers += [orthogonal_linear(width, h), ACTIVATIONS[activation]()]
        width = h
    layers.append(orthogonal_linear(width, n_out, out_gain))
    return nn.Sequential(*layers)
