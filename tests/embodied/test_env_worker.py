"""The env worker's resets: derived from the run's seed, the iteration and the rank; every
env group's at the same time."""

import torch

from m2flow.runs import seeding
from m2flow.embodied.workers.env_worker import EnvWorker
from m2flow.envs import env_config
from m2flow.pipelines import RankResources, WorkerInfo


def first_obs(seed, rank=0, iteration=0, stages=1):
    info = WorkerInfo("env", rank, 2, RankResources(0, 1.0, ()), "local")
    worker = EnvWorker(info, env_config(name="gym/Pendulum-v1", num_envs=3), seed=seed, groups=stages)
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
    cfg = env_config(name="test/Rendezvous", num_envs=4,
                     folder=str(tmp_path), parties=4)
    worker = EnvWorker(info, cfg, seed=0, groups=4)
    try:
        obs = worker._reset(seeding.TRAIN, 0)
    finally:
        worker.close()
    assert [o.batch_size[0] for o in obs] == [1, 1, 1, 1]
    assert len(list(tmp_path.iterdir())) == 4


def test_the_groups_of_a_stage_step_their_action_chunks_side_by_side(tmp_path):
    """A stage of 2 groups (one process env each) gets chunks of 3 actions. Each step after
    the first waits until the other env has started the same step (test/Rendezvous with
    steps): it passes only if the worker runs the groups' chunks in lockstep. Waiting for
    one group's whole chunk before the other's (the chunk's later steps run while it is
    waited for) leaves the first env's step 1 waiting alone, and it fails. The chunks'
    results are each env's own: rewards are the actions it was given."""
    from types import SimpleNamespace

    import tests.fakes as fakes

    fakes.register()
    info = WorkerInfo("env", 0, 1, RankResources(0, 1.0, ()), "local")
    cfg = env_config(name="test/Rendezvous", num_envs=2,
                     folder=str(tmp_path), parties=2, steps=True)
    worker = EnvWorker(info, cfg, seed=0, groups=2)
    try:
        worker._reset(seeding.TRAIN, 0)
        chunks = [torch.tensor([[[1.0], [2.0], [3.0]]]), torch.tensor([[[4.0], [5.0], [6.0]]])]
        for env, chunk in zip(worker.envs, chunks):
            env.step_async(chunk)
        outs = worker._wait(SimpleNamespace(stage_groups=[[0, 1]]), 0)
    finally:
        worker.close()
    assert [o["next", "step_reward"].tolist() for o in outs] == [[[1.0, 2.0, 3.0]],
                                                                 [[4.0, 5.0, 6.0]]]
    assert sorted(f.name.split("-")[0] for f in tmp_path.iterdir()
                  if f.name.startswith("step")) == ["step1", "step1", "step2", "step2"]
