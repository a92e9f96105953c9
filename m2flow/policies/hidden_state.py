"""Dims of ``("obs", "state")`` a policy's actor is not shown: a setting lists them as
[start, end) ranges (``policy.actor_hidden_state`` of mlp and cnn, ``policy.proprio_hidden``
of openvla_oft), and the actor reads 0 there (after its normalisation).

Behaviour cloning needs it where the state holds the robot's joint velocities (ManiSkill's
Panda: dims 9-17, after its 9 joint positions): a cloned policy that reads them learns to
continue the motion it sees instead of choosing one, so from rest it stays at rest (the
"copycat" failure of imitation, Wen et al. 2020).

>>> ranges([[9, 18]], 25, "policy.actor_hidden_state")
[(9, 18)]
>>> sees([(1, 3)], 5, offset=1).tolist()
[1.0, 1.0, 0.0, 0.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from m2flow.policies.base import PolicyError


def ranges(value, size: Optional[int], field: str) -> list[tuple[int, int]]:
    """``value`` (the setting ``field``: a list of [start, end) pairs, or None) as pairs within
    [0, size) (None: the state's size is not known yet, at start-up); a one-line PolicyError
    naming ``field`` for anything else."""
    value = value or []
    top = size if size is not None else float("inf")
    out = []
    for r in value:
        ok = (isinstance(r, Sequence) and len(r) == 2 and all(isinstance(i, int) for i in r)
              and 0 <= r[0] < r[1] <= top)
        if not ok:
            bound = f" <= {size}, the state's size" if size is not None else ""
            raise PolicyError(
                f"{field}={_plain(value)}: each entry is a [start, end) range of the state's "
                f"dims, 0 <= start < end{bound} (e.g. [[9, 18]] hides ManiSkill Panda's joint "
                "velocities).")
        out.append((int(r[0]), int(r[1])))
    return out


def sees(hidden: list[tuple[int, int]], n: int, offset: int = 0,
         device=None) -> Optional[torch.Tensor]:
    """(n,) ones with 0 at ``offset + [start, end)`` for each range (``offset``: where the
    state starts in the actor's input), to multiply that input by; None for no range."""
    if not hidden:
        return None
    out = torch.ones(n, device=device)
    for start, end in hidden:
        out[offset + start:offset + end] = 0.0
    return out


def _plain(value):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
