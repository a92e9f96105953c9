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
    """One PushCube-v1 planner demonstration (64 px rgb + state, and the simulator state for
    the recipe's auxiliary loss) written by m2flow-demos."""
    return one_demo(tmp_path_factory.mktemp("demos"),
                    ["env=maniskill_pushcube_rgb", "env.privileged_state=true"])


def test_bc_flow_matching_on_a_pushcube_demo_lowers_its_loss(tmp_path, pushcube_demos):
    rc = train(["--config-name", "maniskill_pushcube_bc_pi0_tiny", *TINY, "cluster=inprocess",
                f"algorithm.dataset={pushcube_demos}", "algorithm.batch_size=64",
                "algorithm.num_minibatches=2", "algorithm.update_epochs=2",
                "algorithm.aux_pretrain_iterations=0",  # cloning from the first iteration
                "runner.num_iterations=6", f"runner.log_dir={tmp_path}"])
    assert rc == 0
    run_dir = next(tmp_path.glob("*/*/checkpoints/last.pt")).parent.parent
    losses = logged(run_dir, "loss/loss_bc")
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.7 * losses[0], losses
    assert len(logged(run_dir, "loss/loss_aux")) == 6  # the recipe's grounding, kept on


def test_ppo_through_the_vlas_chain_runs_two_iterations(tmp_path, capsys):
    """In-process workers (the chain's PPO on Ray workers: tests/e2e/test_flow_train.py's
    flow_mlp; π0 adds no transport of its own)."""
    rc = train(["--config-name", "maniskill_pushcube_ppo_pi0_tiny", *TINY, "cluster=inprocess",
                "policy.variant=pi05", "runner.rollout_steps=2", "runner.num_iterations=2",
                "policy.hold_obs_norm=false",  # from random weights: no statistics to hold
                "algorithm.update_epochs=1", "algorithm.critic_warmup=0",
                f"runner.log_dir={tmp_path}"])
    assert rc == 0
    assert "done: 2 iterations, 32 env steps" in capsys.readouterr().out  # 2 x 2 envs x 2 x 4
    metrics = checkpoint.load(next(tmp_path.glob("*/*/checkpoints/last.pt")))["metrics"]
    assert all(math.isfinite(metrics[f"loss/{k}"]) for k in ("approx_kl", "loss_policy"))
    assert metrics["loss/entropy"] == 0  # Flow-SDE's σ is fixed: no entropy term


def test_ppo_starts_from_the_bc_recipes_checkpoint(tmp_path, pushcube_demos, capsys):
    """README's π0 recipe: BC (its policy has a value head, which BC does not train), then PPO
    with a privileged critic ``init_from`` that checkpoint: the head is not loaded, every
    other weight is, and the first deterministic actions are BC's."""
    import torch

    bc = tmp_path / "bc"
    assert train(["--config-name", "maniskill_pushcube_bc_pi0_tiny", *TINY, "cluster=inprocess",
                  f"algorithm.dataset={pushcube_demos}", "algorithm.batch_size=16",
                  "runner.num_iterations=1", f"runner.log_dir={bc}"]) == 0
    bc_ckpt = next(bc.glob("*/*/checkpoints/last.pt"))
    bc_weights = checkpoint.load(bc_ckpt)["learner"]["policy"]
    assert any(k.startswith("value_head.") for k in bc_weights)
    rl = tmp_path / "rl"
    assert train(["--config-name", "maniskill_pushcube_ppo_pi0_tiny", *TINY, "cluster=inprocess",
                  f"init_from={bc_ckpt}", "runner.rollout_steps=2", "runner.num_iterations=1",
                  "algorithm.critic_warmup=1", f"runner.log_dir={rl}"]) == 0
    assert f"policy weights from {bc_ckpt}" in capsys.readouterr().out
    rl_weights = checkpoint.load(next(rl.glob("*/*/checkpoints/last.pt")))["learner"]["policy"]
    assert not any(k.startswith("value_head.") for k in rl_weights)
    actor = [k for k in rl_weights if k in bc_weights]
    assert len(actor) > 100  # the whole VLA; the warm-up iteration trains only the critic
    assert all(torch.equal(rl_weights[k], bc_weights[k]) for k in actor)
