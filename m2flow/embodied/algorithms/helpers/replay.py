"""The replay buffer of off-policy learning: a ring of transitions on the learner's device,
sampled uniformly, and a sampler that mixes several buffers at fixed ratios (online and
demonstrations, as RLPD does).

A transition is one row of an env worker's (N, T) trajectory: the step's observation and
action at the root, and under ``"next"`` its reward, ``terminated``, ``truncated`` and the
observation that followed. At an auto-reset the env puts the episode's final observation under
``"next"`` and the new episode's first at the root of the next step (the env contract), so every
row is a true (s, a, r, s') across episode boundaries; a time-out keeps its s' for the
bootstrap and a termination does not bootstrap (the algorithm reads the two flags).

>>> import torch
>>> buf = ReplayBuffer(capacity=4)
>>> buf.add(TensorDict({"x": torch.arange(3.0)}, batch_size=[3]))
>>> buf.add(TensorDict({"x": torch.arange(3.0, 6.0)}, batch_size=[3]))  # 2 rows overwritten
>>> len(buf), buf.stored()["x"]  # oldest first
(4, tensor([2., 3., 4., 5.]))
>>> buf.sample(3, generator=torch.Generator().manual_seed(0)).batch_size
torch.Size([3])
"""

from __future__ import annotations

from typing import Optional

import torch
from tensordict import TensorDict

from m2flow import keys

TRANSITION_KEYS = (keys.OBS, keys.ACTION, keys.REWARD, keys.NEXT_OBS, keys.TERMINATED,
                   keys.TRUNCATED)
"""What a transition keeps of a trajectory step (``done`` is ``terminated | truncated``)."""


def transitions(traj: TensorDict) -> TensorDict:
    """An env worker's (N, T) trajectory -> its (N*T,) transitions (:data:`TRANSITION_KEYS`),
    without the steps whose ``valid`` is False (a lost episode's).

    >>> import torch
    >>> n, t = 2, 3
    >>> traj = TensorDict({"obs": {"state": torch.zeros(n, t, 4)}, "action": torch.zeros(n, t, 1),
    ...     "log_prob": torch.zeros(n, t), "next": {"obs": {"state": torch.ones(n, t, 4)},
    ...     "reward": torch.ones(n, t), "terminated": torch.zeros(n, t, dtype=torch.bool),
    ...     "truncated": torch.zeros(n, t, dtype=torch.bool),
    ...     "done": torch.zeros(n, t, dtype=torch.bool)}}, batch_size=[n, t])
    >>> rows = transitions(traj)
    >>> rows.batch_size, sorted("/".join(k) if isinstance(k, tuple) else k
    ...                         for k in rows.keys(include_nested=True, leaves_only=True))
    (torch.Size([6]), ['action', 'next/obs/state', 'next/reward', 'next/terminated', 'next/truncated', 'obs/state'])
    """
    flat = traj.reshape(-1)  # (N*T,)
    if keys.VALID in flat.keys():
        flat = flat[flat[keys.VALID]]
    return flat.select(*TRANSITION_KEYS)


class ReplayBuffer:
    """At most ``capacity`` transitions (TensorDict rows) on ``device``; the oldest are
    overwritten first. Storage is allocated from the first rows added, with their keys,
    shapes and dtypes (pixels stay uint8).

    Args:
        capacity: rows kept.
        device: where the rows live (the learner's device: sampling never crosses devices).
    """

    def __init__(self, capacity: int, device: torch.device | str = "cpu"):
        if capacity < 1:
            raise ValueError(f"replay buffer capacity must be >= 1, got {capacity}.")
        self.capacity = capacity
        self.device = torch.device(device)
        self._data: Optional[TensorDict] = None  # (capacity,)
        self._cursor = 0  # the next row written
        self._size = 0
        self.added = 0  # rows ever added (the env steps this buffer has seen)

    def __len__(self) -> int:
        return self._size

    def add(self, rows: TensorDict) -> None:
        """Appends ``rows`` (batch [B]), moved to the buffer's device; past ``capacity`` the
        oldest rows are overwritten (of a batch larger than the buffer, its last rows stay)."""
        n = rows.batch_size[0]
        if n == 0:
            return
        rows = rows.to(self.device)
        if self._data is None:
            self._data = rows[:1].expand(self.capacity).clone()  # (capacity,)
        if n > self.capacity:
            rows, self.added = rows[n - self.capacity:], self.added + n - self.capacity
            n = self.capacity
        idx = (self._cursor + torch.arange(n, device=self.device)) % self.capacity
        self._data[idx] = rows
        self._cursor = (self._cursor + n) % self.capacity
        self._size = min(self.capacity, self._size + n)
        self.added += n

    def sample(self, batch_size: int, *, generator: torch.Generator) -> TensorDict:
        """``batch_size`` rows drawn uniformly with replacement (indices from ``generator``,
        a CPU generator, so a seeded run draws the same rows on any device)."""
        if self._size == 0:
            raise ValueError("sampling an empty replay buffer (no transitions added yet).")
        idx = torch.randint(self._size, (batch_size,), generator=generator)
        return self._data[self._physical(idx).to(self.device)]

    def stored(self) -> TensorDict:
        """A copy of every stored row, oldest first."""
        if self._data is None:
            raise ValueError("the replay buffer is empty.")
        return self._data[self._physical(torch.arange(self._size)).to(self.device)]

    def _physical(self, logical: torch.Tensor) -> torch.Tensor:
        """Row ``i`` of the oldest-first order -> its index in the ring."""
        start = (self._cursor - self._size) % self.capacity
        return (start + logical) % self.capacity

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The stored rows (host memory, oldest first) and the count of rows ever added."""
        data = None if self._data is None else self.stored().to("cpu")
        return {"capacity": self.capacity, "added": self.added, "data": data}

    def load_state_dict(self, state: dict) -> None:
        """Restores a :meth:`state_dict` (into this buffer's capacity and device: a smaller
        capacity keeps the newest rows)."""
        self._data, self._cursor, self._size, self.added = None, 0, 0, 0
        if state["data"] is not None:
            self.add(state["data"])
        self.added = int(state["added"])


class MixedSampler:
    """Draws each batch from several buffers at fixed ratios (RLPD: online and demonstration
    transitions, half and half). Of ``batch_size`` rows, source ``i`` gets
    ``floor(batch_size * ratio_i)``; each row left over by the rounding goes to a source drawn
    in proportion to the fractional parts, so each source's expected share is exactly its
    ratio for any batch size.

    >>> import torch
    >>> online, demos = ReplayBuffer(8), ReplayBuffer(8)
    >>> online.add(TensorDict({"x": torch.zeros(4)}, batch_size=[4]))
    >>> demos.add(TensorDict({"x": torch.ones(4)}, batch_size=[4]))
    >>> mix = MixedSampler({"online": online, "demos": demos}, {"online": 0.5, "demos": 0.5})
    >>> mix.sample(6, generator=torch.Generator().manual_seed(0))["x"].sum().item()
    3.0
    """

    def __init__(self, sources: dict[str, ReplayBuffer], ratios: dict[str, float]):
        if set(sources) != set(ratios):
            raise ValueError(f"ratios name {sorted(ratios)}, sources are {sorted(sources)}.")
        if any(r < 0 for r in ratios.values()) or abs(sum(ratios.values()) - 1.0) > 1e-6:
            raise ValueError(f"source ratios must be >= 0 and sum to 1, got {ratios}.")
        self.names = sorted(sources)
        self.sources = sources
        self.ratios = torch.tensor([float(ratios[n]) for n in self.names], dtype=torch.float64)

    def counts(self, batch_size: int, generator: torch.Generator) -> list[int]:
        """Rows per source (in ``self.names`` order) for one batch."""
        exact = self.ratios * batch_size
        counts = exact.floor().long()
        left = batch_size - int(counts.sum())
        if left:
            extra = torch.multinomial(exact - counts, left, replacement=True, generator=generator)
            counts += torch.bincount(extra, minlength=len(self.names))
        return counts.tolist()

    def sample(self, batch_size: int, *, generator: torch.Generator) -> TensorDict:
        """One batch of ``batch_size`` rows: the sources' rows concatenated in name order."""
        parts = [self.sources[n].sample(k, generator=generator)
                 for n, k in zip(self.names, self.counts(batch_size, generator)) if k]
        return torch.cat(parts) if len(parts) > 1 else parts[0]
