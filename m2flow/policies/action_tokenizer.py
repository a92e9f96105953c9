"""OpenVLA's action tokenizer: continuous actions in [-1, 1] <-> the last 256 token ids.

As in OpenVLA (``prismatic/vla/action_tokenizer.py``): 256 bin edges ``linspace(-1, 1, 256)``;
an action value becomes ``d = digitize(x, edges)`` in 1..256 and the token ``vocab_size - d``;
a token decodes to the centre of interval ``d - 1`` (255 intervals, the last index clipped).
So decoding an encoded value is off by at most half an interval, 1/255.

Normalised actions map to the robot's units with per-dataset statistics (OpenVLA's
``dataset_statistics.json``): ``a = 0.5 * (x + 1) * (q99 - q01) + q01`` where ``mask`` is true,
``a = x`` elsewhere (the gripper dimension is usually not normalised).

>>> tok = ActionTokenizer(vocab_size=1000)
>>> ids = tok.encode(torch.tensor([-1.0, 0.0, 0.5, 1.0]))
>>> ids.tolist()
[999, 872, 808, 744]
>>> [round(x, 4) for x in tok.decode(ids).tolist()]
[-0.9961, 0.0, 0.502, 0.9961]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

N_BINS = 256


class ActionTokenizer:
    """Maps actions in [low, high] to the last ``n_bins`` ids of a ``vocab_size`` vocabulary."""

    def __init__(self, vocab_size: int, n_bins: int = N_BINS, low: float = -1.0, high: float = 1.0):
        if vocab_size < n_bins:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the {n_bins} action bins.")
        self.vocab_size, self.n_bins, self.low, self.high = vocab_size, n_bins, low, high
        self.edges = torch.linspace(low, high, n_bins, dtype=torch.float64)
        self.centers = ((self.edges[:-1] + self.edges[1:]) / 2).float()

    @property
    def first_id(self) -> int:
        """The smallest token id an action can take (ids ``first_id .. vocab_size - 1``)."""
        return self.vocab_size - self.n_bins

    def encode(self, action: torch.Tensor) -> torch.Tensor:
        """Continuous actions (any shape) -> token ids (int64, same shape)."""
        x = action.double().clamp(self.low, self.high)
        d = torch.bucketize(x, self.edges.to(x.device), right=True)  # numpy's digitize: 1..n_bins
        return (self.vocab_size - d).long()

    def bins(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> bin index 0..n_bins-2 (the decoded interval)."""
        return (self.vocab_size - ids - 1).clamp(0, self.n_bins - 2)

    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> continuous actions (float32), the centres of their intervals."""
        return self.centers.to(ids.device)[self.bins(ids)]


@dataclass
class ActionStats:
    """Per-dimension statistics to un-normalise actions (OpenVLA's ``action`` entry)."""

    q01: Sequence[float]
    q99: Sequence[float]
    mask: Optional[Sequence[bool]] = None
    """True where a dimension is normalised (None: all)."""

    def _as(self, x: torch.Tensor):
        """(q01, q99, mask) as tensors beside ``x``."""
        q01 = torch.as_tensor(self.q01, dtype=x.dtype, device=x.device)
        q99 = torch.as_tensor(self.q99, dtype=x.dtype, device=x.device)
        mask = (torch.ones_like(q01, dtype=torch.bool) if self.mask is None
                else torch.as_tensor(self.mask, dtype=torch.bool, device=x.device))
        return q01, q99, mask

    def unnormalize(self, x: torch.Tensor) -> torch.Tensor:
        q01, q99, mask = self._as(x)
        return torch.where(mask, 0.5 * (x + 1) * (q99 - q01) + q01, x)

    def normalize(self, a: torch.Tensor) -> torch.Tensor:
        q01, q99, mask = self._as(a)
        return torch.where(mask, (2 * (a - q01) / (q99 - q01).clamp_min(1e-8) - 1).clamp(-1, 1), a)

    @classmethod
    def from_openvla(cls, stats: dict, key: str) -> "ActionStats":
        """From a ``dataset_statistics.json`` dict: ``stats[key]["action"]``."""
        if key not in stats:
            raise KeyError(f"unnorm key {key!r} is not in the dataset statistics; known: "
                           f"{sorted(stats)}")
        a = stats[key]["action"]
        return cls(q01=a["q01"], q99=a["q99"], mask=a.get("mask"))
