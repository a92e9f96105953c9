"""The env worker's resets: derived from the run's seed, the iteration and the rank; every
env group's at the same time."""

import torch

from m2flow.runs import seeding
from m2flow.embodied.env_worker import EnvWorker
from m2flow.envs import EnvConfig
from m2flow.pipelines import RankResources, WorkerInfo


def first_obs(seed, rank=0, iteration=0, stages=1):
    info = WorkerInfo("env", rank, 2, RankResources(0, 1.0, ()), "local")
    worker = EnvWorker(info, EnvConfig(name="gym/Pendulum-v1", num_envs=3), seed=seed, groups=stages)
    try:
        return torch.cat([o["state"] for o in worker._reset(seeding.TRAIN, iteration)])
    finally:
        worker.close()


def test_reset_follows_the_run_seed_iteration_and_rank():
    base = first_obs(seed=0)
    assert torch.equal(base, first_obs(seed=0))
    assert not torch.equal(base, first_obs(seed=1))
    assert not torch.equal(base, first_obs(seed=0, rank=1))
    assert not torch.equal(base, first_obs(seed=0, iteration=1))
    assert not torch.equal(base[0], base[1])  # envs of one rank differ too
    assert torch.equal(base, first_obs(seed=0, stages=2))  # env i's seed ignores the stages


def test_the_groups_of_a_worker_reset_at_the_same_time(tmp_path):
    """Each env's reset waits until all 4 have started (test/Rendezvous): 4 groups of one
    process env each pass only if the worker starts every group's reset before it waits for
    any (one after another, the first would wait alone and fail)."""
    import tests.fakes as fakes

    fakes.register()
    info = WorkerInfo("env", 0, 1, RankResources(0, 1.0, ()), "local")
    cfg = EnvConfig(name="test/Rendezvous", num_envs=4,
                    kwargs={"folder": str(tmp_path), "parties": 4})
    worker = EnvWorker(info, cfg, seed=0, groups=4)
    try:
        obs = worker._reset(seeding.TRAIN, 0)
    finally:
        worker.close()
    assert [o.batch_size[0] for o in obs] == [1, 1, 1, 1]
    assert len(list(tmp_path.iterdir())) == 4
