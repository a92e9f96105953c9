"""Meta-World MT10's state control in small (issue 67's (a), configs
``metaworld_mt10_bc_mlp`` then ``metaworld_mt10_ppo_mlp_from_bc``): the experts' demos of two
tasks, BC on them mixed, then PPO from its checkpoint with BC's loss on the same demos beside
PPO's. Real Meta-World and in-process workers (``cluster=inprocess``); the shipped configs with
only the sizes cut."""

import os

import pytest
import torch

os.environ.setdefault("MUJOCO_GL", "egl")
pytest.importorskip("metaworld")

from m2flow.cli.common import load_run_config  # noqa: E402
from m2flow.cli.demos import main as demos_main  # noqa: E402
from m2flow.embodied.runner import EmbodiedRunner  # noqa: E402
from m2flow.runs import checkpoint  # noqa: E402

SMALL = ["cluster=inprocess", "env.task_ids=[0,1]", "env.num_envs=2", "runner.eval_interval=0",
         "runner.eval_episodes=4", "runner.progress_bar=false", "runner.checkpoint_interval=0"]


def train(config, tmp, name, *extra):
    runner = EmbodiedRunner(load_run_config(config, [*SMALL, f"runner.log_dir={tmp}",
                                                     f"run_name={name}", *extra]))
    try:
        summary = runner.train()
        return runner.run_dir / "checkpoints" / "last.pt", summary
    finally:
        runner.close()


@pytest.fixture(scope="module")
def bc(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mt10")
    assert demos_main(["env=metaworld_mt10", "env.obs_mode=state", "env.task_ids=[0,1]",
                       "demos.episodes_per_task=2", f"demos.output={tmp / 'demos'}"]) == 0
    data = tmp / "demos.h5"
    ckpt, _ = train("metaworld_mt10_bc_mlp", tmp, "bc", f"algorithm.dataset={data}",
                    "runner.num_iterations=30")
    return tmp, data, ckpt


def test_ppo_from_the_clone_starts_from_its_weights_and_keeps_the_demos_loss(bc):
    tmp, data, bc_ckpt = bc
    ckpt, summary = train("metaworld_mt10_ppo_mlp_from_bc", tmp, "ppo", f"init_from={bc_ckpt}",
                          f"algorithm.demo_dataset={data}", "runner.num_iterations=2",
                          "runner.rollout_steps=20", "algorithm.critic_warmup=1")
    assert summary["env_steps"] == 2 * 2 * 20 and summary["eval/episodes"] == 4
    rl = checkpoint.load(ckpt)
    m = rl["metrics"]
    # (a Gaussian's NLL of the expert actions: negative once the clone fits them closely)
    assert m["loss/demo_nll"] != 0 and m["loss/loss_demo"] == pytest.approx(0.1 * m["loss/demo_nll"])
    before = checkpoint.load(bc_ckpt)["learner"]["policy"]
    after = rl["learner"]["policy"]
    emb = [k for k in before if "task_emb" in k]
    assert emb, sorted(before)  # the task embedding travels with the clone
    # one actor update (the first iteration trains the new critic alone): a small step from
    # the clone's weights, not fresh ones; the exploration noise is PPO's, not BC's
    moved = max(float((after[k] - before[k]).abs().max()) for k in emb)
    assert 0 < moved < 0.05, moved
    torch.testing.assert_close(after["actor_log_std"],
                               torch.full_like(after["actor_log_std"], -1.6), atol=0.01, rtol=0)
    assert float((before["actor_log_std"] + 1.6).abs().min()) > 0.1  # BC left its own
