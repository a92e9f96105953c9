"""M rollout workers x E env workers under Ray, their weights synced from learner rank 0 over
a gloo link (``cluster.weight_sync=dist``) or as Ray objects (``ray``).

Each sync is checked against the learner's own state dict, fetched by a separate call (not
the bytes the sync sent): every tensor of both rollout ranks bit-equal, the observation
normaliser's buffers included (a delta sync ships them only when they changed). The learner's
weights move at every update, so a sync that left a rank's weights as they were, or wrote a
piece at the wrong offset, fails here. The same seeded run through the two transports gives
the same weights bit for bit at every iteration.
"""

from __future__ import annotations

import pytest
import torch

from m2flow.cli.common import load_run_config
from m2flow.embodied.workers.learner_worker import LearnerWorker
from m2flow.embodied.workers.rollout_worker import RolloutWorker

ITERATIONS = 3
ROLLOUT_WORKERS, ENV_WORKERS = 2, 2


def run(transport: str, log_dir) -> list[dict]:
    """The weights after the start-up sync and after each iteration's: the learner's and
    each rollout rank's."""
    from m2flow.embodied.runner import EmbodiedRunner

    cfg = load_run_config("maniskill_pushcube_ppo_mlp", [
        "env=gym_pendulum", "env.num_envs=2",
        f"cluster.placement.components.rollout.workers={ROLLOUT_WORKERS}",
        f"cluster.placement.components.env.workers={ENV_WORKERS}",
        f"cluster.weight_sync={transport}", "runner.rollout_steps=8",
        f"runner.num_iterations={ITERATIONS}", "runner.eval_interval=0",
        "runner.progress_bar=false", "policy.hidden_sizes=[16,16]",
        "runner.weight_sync_bucket_mb=0.0005",  # 524 B: 16x16 weights travel in row ranges
        f"runner.log_dir={log_dir}"])
    runner = EmbodiedRunner(cfg)
    try:
        assert (runner.weight_link is not None) == (transport == "dist")
        if transport == "dist":
            assert runner.session.links[0].backend == "gloo"
        records = [weights(runner)]
        for it in range(ITERATIONS):
            runner.iterate(it)
            records.append(weights(runner))
    finally:
        runner.close()
    return records


def weights(runner) -> dict:
    return {"learner": runner.learner.call(LearnerWorker.get_weights, ranks=[0]).wait()[0],
            "rollout": runner.rollout.call(RolloutWorker.get_weights).wait()}


def bit_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory) -> dict[str, list[dict]]:
    return {t: run(t, tmp_path_factory.mktemp(t)) for t in ("dist", "ray")}


@pytest.mark.parametrize("transport", ["dist", "ray"])
def test_every_sync_leaves_both_rollout_workers_bit_equal_to_the_learner(runs, transport):
    records = runs[transport]
    assert len(records) == ITERATIONS + 1
    for i, rec in enumerate(records):
        assert len(rec["rollout"]) == ROLLOUT_WORKERS
        for rank, got in enumerate(rec["rollout"]):
            assert bit_equal(got, rec["learner"]), f"sync {i}, rollout rank {rank}"
    for before, after in zip(records, records[1:]):  # every update moved the weights
        changed = [k for k in after["learner"]
                   if not torch.equal(before["learner"][k], after["learner"][k])]
        assert "obs_norm.count" in changed and "actor_mean.2.weight" in changed


def test_the_dist_path_gives_the_ray_paths_weights(runs):
    for i, (d, r) in enumerate(zip(runs["dist"], runs["ray"])):
        assert bit_equal(d["learner"], r["learner"]), f"learner after sync {i}"
        for rank in range(ROLLOUT_WORKERS):
            assert bit_equal(d["rollout"][rank], r["rollout"][rank]), f"sync {i}, rank {rank}"
