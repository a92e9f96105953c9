"""``metaworld_sac_mlp`` (issue 67's off-policy baseline) in small: the shipped config with
only the sizes cut, on real Meta-World push-v3 with in-process workers. Its dense reward
reaches the learner (a random policy's sparse return is 0), episodes run to the time limit,
and SAC updates from the replay buffer."""

import os

import pytest

os.environ.setdefault("MUJOCO_GL", "egl")
pytest.importorskip("metaworld")

from m2flow.cli.common import load_run_config  # noqa: E402
from m2flow.embodied.runner import EmbodiedRunner  # noqa: E402
from m2flow.runs import checkpoint  # noqa: E402

ENVS, STEPS, ITERS, LIMIT = 2, 5, 4, 10
SMALL = ["cluster=inprocess", "env.name=MetaWorld/push-v3", f"env.num_envs={ENVS}",
         f"env.max_episode_steps={LIMIT}", f"runner.rollout_steps={STEPS}",
         f"runner.num_iterations={ITERS}", "runner.eval_interval=0", "runner.eval_episodes=2",
         "runner.progress_bar=false", "runner.checkpoint_interval=0",
         "algorithm.learning_starts=16", "algorithm.batch_size=8",
         "policy.hidden_sizes=[16,16]"]


def test_sac_learns_from_metaworlds_dense_reward(tmp_path):
    cfg = load_run_config("metaworld_sac_mlp", [*SMALL, f"runner.log_dir={tmp_path}"])
    assert (cfg.env.reward_mode, cfg.env.ignore_terminations) == ("dense", True)
    runner = EmbodiedRunner(cfg)
    try:
        summary = runner.train()
        last = runner.run_dir / "checkpoints" / "last.pt"
    finally:
        runner.close()
    assert summary["env_steps"] == ITERS * ENVS * STEPS
    assert summary["eval/episodes"] == 2 and summary["eval/episode_len"] == LIMIT
    # push-v3's shaped reward is positive away from the goal too; success alone would give 0
    assert summary["eval/return"] > 0 and summary["eval/success_at_end"] == 0
    m = checkpoint.load(last)["metrics"]
    # 16 transitions stored after 2 iterations, then utd 0.5 of the 10 added per iteration
    assert m["replay/size"] == ITERS * ENVS * STEPS and m["loss/updates"] > 0
