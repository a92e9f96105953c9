"""The tiny VLA + GRPO config on real LIBERO envs: 2 iterations, then m2flow-eval loads it."""

import json

from m2flow.cli import evaluate, train

SHORT = ["env.max_episode_steps=16", "runner.rollout_steps=2", "env.kwargs.settle_steps=1",
         "runner.eval_episodes=2", "runner.eval_interval=0", "runner.progress_bar=false",
         "algorithm.filter_low=-1", "algorithm.filter_high=2"]  # keep groups: no success here


def test_libero_grpo_openvla_oft_tiny_trains_two_iterations_and_evaluates(tmp_path, capsys):
    rc = train(["--config-name", "libero_spatial_grpo_openvla_oft_tiny", "cluster=inprocess",
                "runner.num_iterations=2", f"runner.log_dir={tmp_path}", *SHORT])
    assert rc == 0
    out = capsys.readouterr().out
    # 2 iterations x 4 envs x 2 policy calls x chunks of 8 env steps
    assert "done: 2 iterations, 128 env steps" in out
    run = next(tmp_path.glob("libero_spatial_grpo_openvla_oft_tiny/*"))
    ckpt = run / "checkpoints" / "last.pt"
    rc = evaluate([f"checkpoint={ckpt}", "episodes_per_task=1", "env.kwargs.task_ids=[0,1]",
                   "videos_per_task=0", "cluster=inprocess", f"output_dir={tmp_path / 'eval'}"])
    assert rc == 0
    report = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert report["policy"] == "openvla_oft" and len(report["tasks"]) == 2
    assert all(t["episodes"] == 1 and t["mean_length"] <= 16 for t in report["tasks"])


def test_maniskill_pickcube_ppo_openvla_tiny_runs_ppo_with_the_value_head(tmp_path, capsys):
    rc = train(["--config-name", "maniskill_pickcube_ppo_openvla_tiny", "cluster=inprocess",
                "runner.num_iterations=1", "runner.rollout_steps=4", "env.num_envs=2",
                "runner.eval_episodes=2", "env.max_episode_steps=6", "runner.progress_bar=false",
                f"runner.log_dir={tmp_path}"])
    assert rc == 0
    assert "done: 1 iterations, 8 env steps" in capsys.readouterr().out
    log = next(tmp_path.glob("*/*/train.log")).read_text()
    assert "vloss" in log  # the critic (value head) is trained
