"""The env worker's resets: derived from the run's seed, the iteration and the rank."""

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
