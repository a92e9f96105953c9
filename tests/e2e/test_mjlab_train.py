"""The mjlab configs end to end on Warp's CPU device: Cartpole under Ray (env, rollout and
learner workers as processes) in two pipeline stages (two mjlab envs in the env worker),
Lift-Cube from state with the privileged critic and from the wrist camera (a CNN, the tiny VLA), each for an
iteration or two."""

from m2flow.cli.train import main as train

SMALL = ["runner.progress_bar=false", "runner.eval_episodes=4", "env.max_episode_steps=10"]


def test_cartpole_trains_under_ray(tmp_path, capsys):
    rc = train(["--config-name", "mjlab_cartpole_ppo_mlp", "env.num_envs=8",
                "runner.num_iterations=2", "runner.rollout_steps=8", "runner.eval_interval=2",
                "staging.pipeline_stages=2",
                f"runner.log_dir={tmp_path}", *SMALL])
    assert rc == 0
    assert "done: 2 iterations, 128 env steps" in capsys.readouterr().out
    log = next(tmp_path.glob("mjlab_cartpole_ppo_mlp/*/train.log")).read_text()
    assert "| eval " in log and "eval_return" in log and "env_sim" in log and "learner_learn" in log


def test_liftcube_state_and_rgb_run_an_iteration_in_process(tmp_path, capsys):
    for name in ("mjlab_liftcube_ppo_mlp", "mjlab_liftcube_ppo_cnn", "mjlab_liftcube_ppo_openvla_tiny"):
        rc = train(["--config-name", name, "cluster=inprocess", "env.num_envs=4",
                    "runner.num_iterations=1", "runner.rollout_steps=6", "runner.eval_interval=0",
                    f"runner.log_dir={tmp_path}", *SMALL])
        assert rc == 0, name
        assert "done: 1 iterations, 24 env steps" in capsys.readouterr().out, name
