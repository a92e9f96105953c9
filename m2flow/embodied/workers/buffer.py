"""The trajectory buffer: a preallocated (num_envs, T) TensorDict filled one step at a time."""

from __future__ import annotations

from typing import Optional

from tensordict import TensorDict


class TrajectoryBuffer:
    """Collects ``T`` steps of ``num_envs`` envs; storage is allocated from the first step.

    >>> import torch
    >>> buf = TrajectoryBuffer(num_steps=3)
    >>> for t in range(3):
    ...     buf.add(TensorDict({"reward": torch.full((2,), float(t))}, batch_size=[2]))
    >>> buf.data()["reward"]
    tensor([[0., 1., 2.],
            [0., 1., 2.]])
    """

    def __init__(self, num_steps: int):
        self.num_steps = num_steps
        self._data: Optional[TensorDict] = None
        self._t = 0

    def add(self, step: TensorDict) -> None:
        """Writes one step (batch [num_envs]) at the next time index."""
        if self._t >= self.num_steps:
            raise IndexError(f"trajectory buffer is full ({self.num_steps} steps); call data().")
        if self._data is None:
            n = step.batch_size[0]
            self._data = step.unsqueeze(1).expand(n, self.num_steps).clone()  # (N, T)
        self._data[:, self._t] = step
        self._t += 1

    def invalidate(self, env: int, steps_back: int) -> None:
        """Marks env ``env``'s last step and the ``steps_back`` before it (as far as this
        trajectory goes) not valid: key ``"valid"``, which the step must carry."""
        start = max(0, self._t - 1 - steps_back)
        self._data["valid"][env, start : self._t] = False

    def data(self) -> TensorDict:
        """The full (num_envs, T) trajectory; the buffer is then empty again."""
        if self._t != self.num_steps:
            raise ValueError(f"trajectory has {self._t} of {self.num_steps} steps.")
        data, self._data, self._t = self._data, None, 0
        return data
