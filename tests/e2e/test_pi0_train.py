"""``policy=pi0`` (the tiny π0-style VLA) end to end on ManiSkill PushCube-v1 from its camera:
behaviour cloning (flow matching) on a planner demonstration, and PPO through the denoising
chain with Ray workers."""

import math

import pytest

from m2flow.cli.train import main as train
from m2flow.runs import checkpoint
from tests.planner_demos import logged, one_demo

TINY = ["env.num_envs=2", "runner.eval_interval=0", "runner.eval_episodes=2",
        "runner.progress_bar=false", "env.max_episode_steps=16",
        "policy.image_size=32"]  # the tower resizes the 64 px frames: 16 patches, not 64


@pytest.fixture(scope="module")
def pushcube_demos(tmp_path_factory):
    """One PushCube-v1 planner demonstration (64 px rgb + state) written by m2flow-demos."""
    return one_demo(tmp_path_factory.mktemp("demos"), ["env=maniskill_pushcube_rgb"])


def test_bc_flow_matching_on_a_pushcube_demo_lowers_its_loss(tmp_path, pushcube_demos):
    rc = train(["--config-name", "maniskill_pushcube_bc_pi0_tiny", *TINY, "cluster=inprocess",
                f"algorithm.dataset={pushcube_demos}", "algorithm.batch_size=64",
                "algorithm.num_minibatches=2", "algorithm.update_epochs=2",
                "runner.num_iterations=6", f"runner.log_dir={tmp_path}"])
    assert rc == 0
    run_dir = next(tmp_path.glob("*/*/checkpoints/last.pt")).parent.parent
    losses = logged(run_dir, "loss/loss_bc")
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.7 * losses[0], losses


def test_ppo_through_the_vlas_chain_runs_two_iterations_on_ray_workers(tmp_path, ray_cluster,
                                                                       capsys):
    rc = train(["--config-name", "maniskill_pushcube_ppo_pi0_tiny", *TINY,
                "policy.variant=pi05", "runner.rollout_steps=2", "runner.num_iterations=2",
                "algorithm.update_epochs=1", "algorithm.critic_warmup=0",
                f"runner.log_dir={tmp_path}"])
    assert rc == 0
    assert "done: 2 iterations, 32 env steps" in capsys.readouterr().out  # 2 x 2 envs x 2 x 4
    metrics = checkpoint.load(next(tmp_path.glob("*/*/checkpoints/last.pt")))["metrics"]
    assert all(math.isfinite(metrics[f"loss/{k}"]) for k in ("approx_kl", "loss_policy"))
    assert metrics["loss/entropy"] == 0  # Flow-SDE's σ is fixed: no entropy term
