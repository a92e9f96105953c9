"""Elastic pipelining: stages keep each env's trajectory in order and identical for any S,
M env workers route to N rollout workers, and learner overlap respects the staleness bound."""

import itertools

from tests import fakes
import pytest
import torch
from tensordict import TensorDict
from tests.pipelines.test_channel import Relay

from m2flow import keys
from m2flow.cli.common import load_run_config
from m2flow.runs import seeding
from m2flow.embodied.workers.learner_worker import check_staleness
from m2flow.embodied.runner import EmbodiedRunner
from m2flow.pipelines import Channel, RankResources, WorkerGroup
from m2flow.runs.timeline import OVERLAP_KEY

STEPS = 12


def fake_runner(stages, num_envs=7, env_workers=1, rollout_workers=1, *extra, env="test/Counter"):
    fakes.register()
    cfg = load_run_config("maniskill_pushcube_ppo_mlp", [
        "cluster=inprocess", f"env.name={env}", f"env.num_envs={num_envs}",
        "policy.name=test/echo", f"staging.pipeline_stages={stages}",
        f"runner.rollout_steps={STEPS}", "runner.progress_bar=false",
        f"cluster.placement.components.env.workers={env_workers}",
        f"cluster.placement.components.rollout.workers={rollout_workers}", *extra,
    ])
    return EmbodiedRunner(cfg)


def collect(runner, iteration=0):
    runner.collect(iteration)
    return [runner.traj_ch.get(key=e, timeout=10) for e in runner.env_ranks]


def check_in_order(traj, seeds):
    """Env i: its own reset seed throughout, t counting 0..4 per episode, its own actions."""
    state = traj["obs", "state"]  # (N, T, 3): seed, t, last action
    assert traj.batch_size == (len(seeds), STEPS)
    assert torch.equal(state[:, :, 0], torch.tensor(seeds, dtype=torch.float32)[:, None].expand(-1, STEPS))
    t = torch.arange(STEPS, dtype=torch.float32) % fakes.EPISODE
    assert torch.equal(state[:, :, 1], t.expand(len(seeds), -1))
    torch.testing.assert_close(traj["action"][..., 0], 0.1 * (state[:, :, 0] + state[:, :, 1]))


ENVS = ["test/Counter", "test/CounterProc"]  # stepped in this thread | in subprocesses


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_stages_keep_each_envs_trajectory_in_order_with_uneven_env_counts(stages, env):
    runner = fake_runner(stages, 7, env=env)  # 7 envs: stages of 7 | 4+3 | 3+2+2
    try:
        (traj,) = collect(runner)
        seeds = [s % 1000 for s in seeding.derive(runner.cfg.seed, seeding.TRAIN, 0, 0, 7)]
        check_in_order(traj, seeds)
    finally:
        runner.close()


@pytest.mark.parametrize("env", ENVS)
def test_trajectories_of_two_and_three_stages_equal_one_stage(env):
    trajs = {}
    for stages in (1, 2, 3):
        runner = fake_runner(stages, 7, env=env)
        try:
            trajs[stages] = [collect(runner, it)[0] for it in range(2)]
        finally:
            runner.close()
    for stages in (2, 3):
        for a, b in zip(trajs[1], trajs[stages]):
            assert (a == b).all(), f"S={stages} differs from S=1"


def test_m_env_workers_route_stages_to_n_rollout_workers_without_a_relay():
    runner = fake_runner(3, 5, 2, 3)  # 2 env workers x 3 stages -> 3 rollout workers
    try:
        trajs = collect(runner)
        for e, traj in enumerate(trajs):
            seeds = [s % 1000 for s in seeding.derive(runner.cfg.seed, seeding.TRAIN, 0, e, 5)]
            check_in_order(traj, seeds)
        for r, worker in enumerate(runner.rollout.handles):
            expect = {(e, k) for e in range(2) for k in range(3) if (k * 2 + e) % 3 == r}
            assert dict(worker.served) == {key: STEPS for key in expect}
    finally:
        runner.close()


def test_stages_reach_every_rollout_rank_equally_when_m_divides_e_times_s():
    """For any stage count (it may change at run time, up to staging.env_groups)."""
    from collections import Counter

    from m2flow.embodied.workers.stages import rollout_rank

    for e, s, m in itertools.product(range(1, 5), range(1, 5), range(1, 9)):
        loads = Counter(rollout_rank(w, k, e, m) for k in range(s) for w in range(e))
        even = len(loads) == m and len(set(loads.values())) == 1
        assert even == ((e * s) % m == 0), (e, s, m, loads)


def test_overlapped_learner_keeps_staleness_within_the_bound():
    runner = fake_runner(2, 4, 1, 1, "runner.overlap_learner=true", "runner.num_iterations=4",
                         "algorithm.update_epochs=2")
    try:
        metrics = [runner.iterate(it) for it in range(4)]
        runner.drain()
    finally:
        runner.close()
    stale = [m["perf/staleness"] for m in metrics]
    assert stale[0] == 0  # nothing collected ahead yet
    assert all(0 <= s <= 1 for s in stale)
    # iterations 1-3 were collected beside the update before them: at most that long
    assert OVERLAP_KEY not in metrics[0]
    for before, m in zip(metrics, metrics[1:]):
        assert 0 < m[OVERLAP_KEY] <= before["time/driver_learn_wait"], (before, m)


def test_without_overlap_no_learning_is_reported_beside_collection():
    runner = fake_runner(1, 4, 1, 1, "runner.num_iterations=2")
    try:
        metrics = [runner.iterate(it) for it in range(2)]
    finally:
        runner.close()
    assert all(OVERLAP_KEY not in m for m in metrics)


def test_staleness_beyond_the_bound_is_refused():
    part = fakes.CounterEnv(type("C", (), {"num_envs": 2})()).reset(seed=[1, 2])
    part[keys.POLICY_VERSION] = torch.tensor([3, 5])
    assert check_staleness([part], 5, max_staleness=2) == 2
    with pytest.raises(RuntimeError, match="2 updates stale, more than runner.max_staleness=1"):
        check_staleness([part], 5, max_staleness=1)


def test_more_stages_than_envs_is_a_config_error():
    with pytest.raises(ValueError, match=r"staging.pipeline_stages=5.*env.num_envs=4"):
        fake_runner(5, 4)


def test_ray_workers_pipeline_two_env_ranks_into_one_rollout_rank(ray_cluster):
    cfg = load_run_config("maniskill_pushcube_ppo_mlp", [
        "env=gym_pendulum", "env.num_envs=3", "staging.pipeline_stages=2",
        "runner.rollout_steps=8", "runner.progress_bar=false",
        "cluster.placement.components.env.workers=2",
    ])
    runner = EmbodiedRunner(cfg)
    sink = WorkerGroup(ray_cluster, "sink", Relay, [RankResources(0, 1.0, ())])
    try:
        # the trajectories go to a sink actor the test can read from, not to the learner
        runner.traj_ch = Channel("trajectory", sink, item_type=TensorDict, routes={0: 0, 1: 0})
        runner.collect(0)
        trajs = [sink.call(Relay.consume, runner.traj_ch, 1, e).wait()[0][0] for e in (0, 1)]
        assert [t.batch_size for t in trajs] == [torch.Size([3, 8])] * 2
        assert all((t[keys.POLICY_VERSION] == 0).all() for t in trajs)
        first = [t["obs", "state"][:, 0] for t in trajs]
        assert not torch.equal(first[0], first[1])  # each rank its own reset seeds
    finally:
        sink.shutdown()
        runner.close()


def test_stage_count_changes_at_run_time_without_rebuilding_the_envs():
    runner = fake_runner(2, 7, 1, 1, "staging.env_groups=4")
    try:
        envs = runner.env.handles[0].envs
        got = {}
        for stages in (1, 2, 3, 4):
            runner.set_stages(stages)
            got[stages] = collect(runner)[0]
        assert runner.env.handles[0].envs is envs
        for stages in (2, 3, 4):
            assert (got[stages] == got[1]).all()
    finally:
        runner.close()
