"""The stage scheduler of an env worker: envs -> env groups -> S contiguous pipeline stages.

An env worker builds its envs once, as G env groups (one batched env each). A pipeline stage
is a contiguous run of groups, so the stage count S can change from 1 to G at every call
without rebuilding a simulator (elastic pipelining). Both cuts are as even as possible, the
first parts one larger. Pure functions: no simulator, no worker.

>>> sizes = stage_sizes(7, 4)  # 7 envs in 4 groups
>>> sizes
[2, 2, 2, 1]
>>> stage_groups(len(sizes), 3)  # 3 stages: groups 0+1, 2, 3 (envs 4 | 2 | 1)
[[0, 1], [2], [3]]
"""

from __future__ import annotations


def stage_sizes(num_envs: int, stages: int) -> list[int]:
    """Envs per stage (or group): as even as possible, the first ones one more.

    >>> stage_sizes(7, 3)
    [3, 2, 2]
    """
    if not 1 <= stages <= num_envs:
        raise ValueError(
            f"staging.pipeline_stages={stages} (or staging.env_groups) with env.num_envs="
            f"{num_envs}: every stage needs at least one env; use 1 to {num_envs}."
        )
    base, extra = divmod(num_envs, stages)
    return [base + (k < extra) for k in range(stages)]


def stage_groups(num_groups: int, stages: int) -> list[list[int]]:
    """The env groups of each stage: ``stages`` contiguous runs of ``range(num_groups)``.

    >>> stage_groups(4, 1), stage_groups(4, 4)
    ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    """
    if not 1 <= stages <= num_groups:
        raise ValueError(
            f"{stages} pipeline stages asked of an env worker built with {num_groups} "
            f"env groups; set staging.env_groups >= {stages} (it defaults to "
            "staging.pipeline_stages)."
        )
    out, start = [], 0
    for n in stage_sizes(num_groups, stages):
        out.append(list(range(start, start + n)))
        start += n
    return out


def offsets(sizes: list[int]) -> list[int]:
    """Index of the first env of each group in the worker's env order.

    >>> offsets([3, 2, 2])
    [0, 3, 5]
    """
    out, start = [], 0
    for n in sizes:
        out.append(start)
        start += n
    return out



def rollout_rank(env_rank: int, stage: int, env_workers: int, rollout_workers: int) -> int:
    """The rollout rank that serves stage (env rank, stage): stages dealt round-robin in the
    order env workers send them (index ``stage * env_workers + env_rank``), so for any stage
    count S each of M rollout ranks serves E x S / M stages of the E env workers when
    M divides E x S. E env workers reach M rollout workers without a relay.

    >>> [rollout_rank(e, k, 2, 2) for k in range(2) for e in range(2)]
    [0, 1, 0, 1]
    """
    return (stage * env_workers + env_rank) % rollout_workers

