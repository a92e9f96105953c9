"""The LIBERO training config on real LIBERO envs: one PPO iteration, image + proprio CNN."""

import pytest

from m2flow.cli.train import main as train


@pytest.mark.slow  # LIBERO training is CI's in the VLA GRPO test (tests/e2e/test_grpo_e2e.py)
def test_libero_spatial_ppo_cnn_runs_one_iteration(tmp_path, capsys):
    rc = train([
        "--config-name", "libero_spatial_ppo_cnn", "cluster=inprocess",
        "runner.num_iterations=1", "runner.rollout_steps=6", "runner.eval_episodes=2",
        "env.max_episode_steps=4", "env.image_size=64", "env.settle_steps=1",
        "runner.progress_bar=false", f"runner.log_dir={tmp_path}",
    ])
    assert rc == 0
    out = capsys.readouterr().out
    assert "done: 1 iterations, 12 env steps" in out
    log = next(tmp_path.glob("libero_spatial_ppo_cnn/*/train.log")).read_text()
    assert "env_sim" in log and "learner_learn" in log
