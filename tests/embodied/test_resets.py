"""Reset scheduling: seeds per env (GRPO groups share one) and the multi-task rotation,
against hand-worked examples."""

import pytest
import torch

from m2flow.embodied.workers.resets import check_group_size, env_seeds, split, train_tasks
from m2flow.runs import seeding


def test_each_env_has_its_own_seed_of_the_run_iteration_and_rank():
    d = seeding.derive(3, seeding.TRAIN, 2, 1, 4)
    assert env_seeds(3, seeding.TRAIN, iteration=2, rank=1, num_envs=4) == d


def test_envs_of_a_grpo_group_share_the_seed_of_their_group():
    d = seeding.derive(0, seeding.TRAIN, 0, 0, 3)  # 6 envs in groups of 2: 3 seeds
    got = env_seeds(0, seeding.TRAIN, iteration=0, rank=0, num_envs=6, group_size=2)
    assert got == [d[0], d[0], d[1], d[1], d[2], d[2]]
    assert len(set(got)) == 3


def test_eval_and_train_seeds_differ():
    kw = dict(iteration=0, rank=0, num_envs=2)
    assert env_seeds(0, seeding.TRAIN, **kw) != env_seeds(0, seeding.EVAL, **kw)


def test_one_task_env_has_no_tasks():
    assert train_tasks(0, num_envs=4, rank=0, iteration=5) is None


def test_tasks_rotate_over_ranks_and_iterations():
    # 10 tasks, 4 envs in groups of 2 -> 2 groups per rank; first group (rank + it) * 2
    assert train_tasks(10, num_envs=4, rank=0, iteration=0, group_size=2) == [0, 0, 1, 1]
    assert train_tasks(10, num_envs=4, rank=1, iteration=0, group_size=2) == [2, 2, 3, 3]
    assert train_tasks(10, num_envs=4, rank=1, iteration=4, group_size=2) == [0, 0, 1, 1]
    # single envs: 3 tasks, 2 envs at iteration 1: tasks 2, 0 (wrapping)
    assert train_tasks(3, num_envs=2, rank=0, iteration=1) == [2, 0]


def test_every_task_gets_envs_and_ranks_swap_their_halves():
    # 2 ranks x 5 envs, 10 tasks: together they cover every task at every iteration
    it0 = [train_tasks(10, num_envs=5, rank=r, iteration=0) for r in (0, 1)]
    it1 = [train_tasks(10, num_envs=5, rank=r, iteration=1) for r in (0, 1)]
    assert it0 == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert it1 == [[5, 6, 7, 8, 9], [0, 1, 2, 3, 4]]


def test_no_env_switches_task_when_a_ranks_groups_are_a_multiple_of_the_tasks():
    for it in range(3):
        assert train_tasks(3, num_envs=6, rank=1, iteration=it) == [0, 1, 2, 0, 1, 2]


def test_group_size_must_divide_the_envs():
    check_group_size(6, 3)
    with pytest.raises(ValueError, match="env.num_envs=4 is not a multiple of algorithm.group_size=3"):
        env_seeds(0, seeding.TRAIN, iteration=0, rank=0, num_envs=4, group_size=3)
    with pytest.raises(ValueError):
        check_group_size(4, 0)


def test_split_cuts_per_env_values_into_groups():
    assert split([1, 2, 3, 4, 5, 6, 7], [3, 2, 2]) == [[1, 2, 3], [4, 5], [6, 7]]
    assert split(None, [3, 4]) == [None, None]


class _FakeManiSkillBatch:
    """ManiSkill's contract for ``reset(options={"env_idx", "reset_to_env_states"})``
    (mani_skill/envs/sapien_env.py): row j of each state tensor goes to env ``env_idx[j]``
    (ascending), the other envs keep theirs, and the obs of every env come back."""

    def __init__(self, n: int):
        self.device = torch.device("cpu")
        self.base_env = self
        self.cube = torch.randn(n, 13, generator=torch.Generator().manual_seed(0))
        self.qpos = torch.randn(n, 9, generator=torch.Generator().manual_seed(1))

    def get_state_dict(self):
        return {"actors": {"cube": self.cube.clone()}, "articulations": {"panda": self.qpos.clone()}}

    def reset(self, seed=None, options=None):
        idx, states = options["env_idx"], options["reset_to_env_states"]["env_states"]
        assert seed is None and torch.equal(idx, idx.sort().values)
        self.cube[idx] = states["actors"]["cube"]
        self.qpos[idx] = states["articulations"]["panda"]
        return torch.cat([self.cube, self.qpos], dim=1), {}


def test_envs_given_one_seed_take_their_leaders_state_on_the_gpu_backend():
    from m2flow.envs.maniskill import group_leaders, share_leader_states

    seeds = [5, 5, 5, 9, 9, 4]
    assert group_leaders(seeds) == [0, 0, 0, 3, 3, 5]
    batch = _FakeManiSkillBatch(6)
    before = torch.cat([batch.cube, batch.qpos], dim=1)  # six different initial states
    obs = share_leader_states(batch, group_leaders(seeds), before)
    for env, leader in enumerate([0, 0, 0, 3, 3, 5]):
        assert torch.equal(obs[env], before[leader]), env
    assert len({tuple(obs[i].tolist()) for i in range(6)}) == 3
    untouched = before.clone()
    assert share_leader_states(batch, group_leaders([1, 2, 3]), untouched) is untouched


@pytest.mark.slow  # three simulator processes: ~20-50 s here
def test_on_the_cpu_backend_envs_given_one_seed_already_start_alike():
    """The meaning the GPU backend is made to keep: each CPU env is its own seeded process."""
    from m2flow.envs import env_config, make_env

    env = make_env(env_config(name="ManiSkill/PushCube-v1", num_envs=3, sim_backend="cpu"))
    try:
        state = env.reset(seed=[11, 11, 12])["obs"]["state"]
    finally:
        env.close()
    assert torch.equal(state[0], state[1]) and not torch.equal(state[0], state[2])
