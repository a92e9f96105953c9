"""Running observation normalisation, kept in the policy's state_dict (so it syncs to rollout
workers and lands in checkpoints with the weights)."""

from __future__ import annotations

import torch
from torch import nn

CLIP = 10.0  # normalised values beyond this many std are outliers; clip them
EPS = 1e-8


class RunningNorm(nn.Module):
    """``(x - mean) / std`` over everything ``update`` has seen (parallel Welford merge).

    >>> norm = RunningNorm(2)
    >>> norm.update(torch.tensor([[0.0, 10.0], [2.0, 30.0]]))
    >>> norm(torch.tensor([[1.0, 20.0]]))
    tensor([[0., 0.]])

    With ``min_std``, a dim that barely moves is not stretched to unit variance:

    >>> jitter = RunningNorm(1, min_std=0.01)
    >>> jitter.update(torch.tensor([[0.0], [0.002]]))
    >>> jitter(torch.tensor([[0.002]]))
    tensor([[0.1000]])
    """

    def __init__(self, dim: int, hold: bool = False, min_std: float = 0.0):
        super().__init__()
        self.hold = hold  # statistics kept as loaded (policy.hold_obs_norm); update does nothing
        # a dim whose spread is below min_std (in its own units) is divided by min_std instead:
        # its jitter stays small rather than being blown up to unit variance
        self.min_std = min_std
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.tensor(0.0))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        if self.hold:
            return
        x = x.reshape(-1, x.shape[-1]).to(self.mean.dtype)  # (B, D)
        n = float(x.shape[0])
        if n == 0:
            return
        b_mean, b_var = x.mean(0), x.var(0, unbiased=False)
        total = self.count + n
        delta = b_mean - self.mean
        m2 = self.var * self.count + b_var * n + delta.pow(2) * self.count * n / total
        self.mean += delta * n / total
        self.var.copy_(m2 / total)
        self.count.copy_(total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.count == 0:
            return x
        std = torch.sqrt(self.var + EPS)
        if self.min_std > 0:
            std = std.clamp_min(self.min_std)
        return ((x - self.mean) / std).clamp(-CLIP, CLIP)


def state_norm(dim: int, cfg, present: bool = True) -> nn.Module:
    """The state normaliser a policy config asks for: a RunningNorm over ``dim`` values under
    ``cfg.normalize_obs`` (held as loaded under ``cfg.hold_obs_norm``) when the env gives a
    state (``present``), else the identity."""
    if cfg.normalize_obs and present:
        return RunningNorm(dim, cfg.hold_obs_norm)
    return nn.Identity()
