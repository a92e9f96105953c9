"""Reset scheduling of an env worker: the seed and the task each env resets to.

Pure functions of (run seed, purpose, iteration, rank, env index), so an iteration replays
exactly on resume, and env i gets the same reset for any stage count or env grouping.

- Seeds: env i of a rank resets from its own seed; with reset groups of ``group_size`` envs
  (GRPO's), envs ``i // group_size`` share one seed, so a group starts from one initial state.
- Tasks (a multi-task env such as LIBERO): group j of rank r trains at iteration t on task
  ``((r + t) * N/g + j) mod num_tasks`` (N envs per rank): the tasks rotate over the
  iterations so every task gets envs; where N/g is a multiple of num_tasks no env ever
  switches task (a switch rebuilds the scene).

>>> train_tasks(num_tasks=10, num_envs=4, rank=1, iteration=0, group_size=2)
[2, 2, 3, 3]
"""

from __future__ import annotations

from typing import Optional

from m2flow.runs import seeding


def env_seeds(seed: int, purpose: int, *, iteration: int, rank: int, num_envs: int,
              group_size: int = 1) -> list[int]:
    """The reset seed of each of ``num_envs`` envs (one per group of ``group_size``).

    >>> s = env_seeds(0, seeding.TRAIN, iteration=0, rank=0, num_envs=4, group_size=2)
    >>> s[0] == s[1] != s[2] == s[3]
    True
    """
    check_group_size(num_envs, group_size)
    per_group = seeding.derive(seed, purpose, iteration, rank, num_envs // group_size)
    return [per_group[i // group_size] for i in range(num_envs)]


def train_tasks(num_tasks: int, *, num_envs: int, rank: int, iteration: int,
                group_size: int = 1) -> Optional[list[int]]:
    """The task of each env (None for a one-task env, ``num_tasks == 0``).

    >>> train_tasks(num_tasks=3, num_envs=2, rank=0, iteration=1)  # first = (0 + 1) * 2
    [2, 0]
    """
    if not num_tasks:
        return None
    check_group_size(num_envs, group_size)
    groups = num_envs // group_size
    first = (rank + iteration) * groups
    return [(first + i // group_size) % num_tasks for i in range(num_envs)]


def check_group_size(num_envs: int, group_size: int) -> None:
    """A worker holds whole GRPO groups: ``group_size`` divides ``num_envs``."""
    if group_size < 1 or num_envs % group_size:
        raise ValueError(
            f"env.num_envs={num_envs} is not a multiple of algorithm.group_size="
            f"{group_size}: each env worker holds whole groups of envs that reset to "
            "the same initial state."
        )


def split(values: Optional[list], sizes: list[int]) -> list[Optional[list]]:
    """``values`` (one per env, or None) cut into one list per env group of ``sizes``.

    >>> split([5, 6, 7], [2, 1]), split(None, [2, 1])
    ([[5, 6], [7]], [None, None])
    """
    if values is None:
        return [None] * len(sizes)
    out, start = [], 0
    for n in sizes:
        out.append(values[start : start + n])
        start += n
    return out
