"""``policy=flow_mlp`` end to end on ManiSkill PickCube-v1 from state: behaviour cloning (flow
matching) on planner demonstrations, and PPO through the denoising chain with Ray workers."""

import math

import pytest
from omegaconf import OmegaConf

from m2flow.cli.train import main as train
from m2flow.runs import checkpoint
from tests.planner_demos import logged, one_demo

TINY = ["env.num_envs=2", "runner.eval_interval=0", "runner.eval_episodes=2",
        "runner.progress_bar=false", "policy.hidden_sizes=[64,64]"]


@pytest.fixture(scope="module")
def pickcube_demos(tmp_path_factory):
    """One PickCube-v1 planner demonstration (state obs) written by m2flow-demos."""
    return one_demo(tmp_path_factory.mktemp("demos"), ["env=maniskill_pickcube", "env.obs_mode=state"])


def test_bc_flow_matching_on_pickcube_demos_lowers_its_loss(tmp_path, pickcube_demos):
    rc = train(["--config-name", "maniskill_pickcube_bc_flow_mlp", *TINY, "cluster=inprocess",
                f"algorithm.dataset={pickcube_demos}", "algorithm.batch_size=128",
                "algorithm.num_minibatches=2", "algorithm.update_epochs=4",
                "runner.num_iterations=20",
                f"runner.log_dir={tmp_path}"])
    assert rc == 0
    run_dir = next(tmp_path.glob("*/*/checkpoints/last.pt")).parent.parent
    losses = logged(run_dir, "loss/loss_bc")
    assert len(losses) == 20
    # flow matching's loss has a floor (its target ε - a is random given x_t): no tenfold fall
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.7 * first, (first, last)


@pytest.mark.parametrize("method", ["flow_sde", "flow_noise"])
def test_ppo_through_the_chain_runs_two_iterations_on_ray_workers(tmp_path, ray_cluster, capsys,
                                                                  method):
    rc = train(["--config-name", "maniskill_pickcube_ppo_mlp", "policy=flow_mlp", *TINY,
                f"policy.noise_method={method}", "runner.rollout_steps=4",
                "runner.num_iterations=2", "algorithm.update_epochs=2",
                "algorithm.ent_coef=0.005", f"runner.log_dir={tmp_path}"])
    assert rc == 0
    assert "done: 2 iterations, 64 env steps" in capsys.readouterr().out  # 2 x 2 envs x 4 x 4
    ckpt = checkpoint.load(next(tmp_path.glob("*/*/checkpoints/last.pt")))
    assert OmegaConf.create(ckpt["config"]).policy.noise_method == method
    metrics = ckpt["metrics"]
    assert all(math.isfinite(metrics[f"loss/{k}"]) for k in ("approx_kl", "loss_policy", "entropy"))
    # Flow-Noise's entropy is its learned noise's, Flow-SDE has none
    assert (metrics["loss/entropy"] < 0) if method == "flow_noise" else metrics["loss/entropy"] == 0
    assert any(k.startswith("noise_head.") for k in ckpt["learner"]["policy"]) == (
        method == "flow_noise")
