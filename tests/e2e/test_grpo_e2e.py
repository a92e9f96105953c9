"""Embodied GRPO end to end: one update of the learner worker on episodes of which some
succeed (advantages and loss against plain-loop hand computations), and the tiny VLA + GRPO
config on real LIBERO envs (2 iterations, then m2flow-eval loads it)."""

import json
import math

import pytest
import torch
from tensordict import TensorDict

from m2flow.cli.eval import main as evaluate
from m2flow.cli.train import main as train
from m2flow.embodied.algorithms.grpo import GRPOConfig
from m2flow.embodied.workers.learner_worker import LearnerWorker
from m2flow.envs import EnvSpec
from m2flow.pipelines import Channel, Cluster, ClusterConfig, RankResources, WorkerGroup
from m2flow.policies import policy_config

SPEC = EnvSpec({"state": (4,)}, 2, (-1.0, -1.0), (1.0, 1.0), 8)

SHORT = ["env.max_episode_steps=16", "runner.rollout_steps=2", "env.settle_steps=1",
         "runner.eval_episodes=2", "runner.eval_interval=0", "runner.progress_bar=false",
         "algorithm.filter_low=-1", "algorithm.filter_high=2"]
# No episode succeeds in two policy calls, so with every group kept all advantages (and the
# loss) are 0: this run checks the plumbing (envs, VLA, learner, checkpoint, eval) and that the
# run says loudly that it has nothing to learn from; the GRPO update itself is checked on
# episodes of which some succeed at the end of this file.


def test_libero_grpo_openvla_oft_tiny_trains_two_iterations_and_evaluates(tmp_path, capsys):
    rc = train(["--config-name", "libero_spatial_grpo_openvla_oft_tiny", "cluster=inprocess",
                "runner.num_iterations=2", f"runner.log_dir={tmp_path}",
                "runner.warn_no_signal_iterations=2", "env.task_ids=[0,1]", "env.num_envs=2",
                *SHORT])
    assert rc == 0
    out = capsys.readouterr().out
    # (two of the suite's tasks: its evaluation runs at least an episode of each task; one
    # group of 2 envs, the config's group size)
    # 2 iterations x 2 envs x 2 policy calls x chunks of 8 env steps
    assert "done: 2 iterations, 64 env steps" in out
    # LIBERO's reward is success only, and nothing succeeded: said once, after 2 iterations
    assert out.count("WARNING: no learning signal for 2 iterations in a row: every reward") == 1
    run = next(tmp_path.glob("libero_spatial_grpo_openvla_oft_tiny/*"))
    ckpt = run / "checkpoints" / "last.pt"
    rc = evaluate([f"checkpoint={ckpt}", "episodes_per_task=1", "env.task_ids=[0,1]",
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


# -- one GRPO update where some episodes succeed, checked by hand ----------------------------
GROUP, N, T = 3, 9, 4
DONE_AT = [1, 3, None, 0, 2, None, 1, None, None]  # first episode's last step (None: runs on)
SUCCESS = [1, 0, 0, 1, 1, 0, 0, 0, 0]  # groups: 1 of 3, 2 of 3, 0 of 3 (dropped) succeed


def grpo_trajectory(policy):
    g = torch.Generator().manual_seed(0)
    done = torch.zeros(N, T, dtype=torch.bool)
    success = torch.zeros(N, T, dtype=torch.bool)
    for i, d in enumerate(DONE_AT):
        if d is not None:
            done[i, d] = True
            success[i, d] = bool(SUCCESS[i])
    reward = torch.rand(N, T, generator=g) + success.float()  # shaped reward + success bonus
    traj = TensorDict({
        "obs": {"state": torch.randn(N, T, 4, generator=g)},
        "action": torch.randn(N, T, 2, generator=g),
        "env_index": torch.arange(N)[:, None].expand(N, T).clone(),  # rides along: for the check
        "next": {"reward": reward, "done": done, "success": success,
                 "terminated": done.clone(), "truncated": torch.zeros_like(done)},
    }, batch_size=[N, T])
    with torch.no_grad():  # behaviour log-probs of the weights the update starts from
        traj["log_prob"] = policy.evaluate_actions(traj.reshape(-1))["log_prob"].reshape(N, T)
    return traj


def hand_advantages(traj) -> dict[int, float]:
    """Plain loops: each env's first-episode return against its group (population std)."""
    out = {}
    for first in range(0, N, GROUP):
        envs = range(first, first + GROUP)
        if len({SUCCESS[i] for i in envs}) == 1:
            continue  # all failed (or all succeeded): dropped
        returns = []
        for i in envs:
            last = DONE_AT[i] if DONE_AT[i] is not None else T - 1
            returns.append(sum(float(traj["next", "reward"][i, t]) for t in range(last + 1)))
        mean = sum(returns) / GROUP
        std = math.sqrt(sum((r - mean) ** 2 for r in returns) / GROUP)
        for i, r in zip(envs, returns):
            out[i] = (r - mean) / (std + 1e-6)
    return out


def test_a_grpo_update_where_some_episodes_succeed_trains_on_hand_computed_advantages():
    cluster = Cluster(ClusterConfig(backend="local", num_gpus=0))
    algo = GRPOConfig(group_size=GROUP, learning_rate=1e-2, update_epochs=1, num_minibatches=1)
    group = WorkerGroup(cluster, "learner", LearnerWorker, [RankResources(0, 1.0, ())],
                        policy_config(name="mlp", hidden_sizes=[16]), algo, SPEC, seed=0,
                        num_iterations=1)
    try:
        worker, ch = group.handles[0], Channel("trajectory", group, item_type=TensorDict)
        seen = []
        loss = worker.algorithm.loss
        worker.algorithm.loss = lambda policy, mb: (seen.append(mb.clone()), loss(policy, mb))[1]
        traj = grpo_trajectory(worker.policy)
        want = hand_advantages(traj)
        before = worker.get_weights()
        ch.put(traj, key=0)
        metrics = group.call(LearnerWorker.update, ch, env_ranks=[0], iteration=0).wait()[0]
    finally:
        group.shutdown()
    mb = torch.cat(seen)  # the one minibatch: every valid step of the kept groups
    steps = {i: (DONE_AT[i] if DONE_AT[i] is not None else T - 1) + 1 for i in want}
    assert sorted(mb["env_index"].tolist()) == sorted(i for i in want for _ in range(steps[i]))
    got = mb["advantage"].tolist()
    assert got == pytest.approx([want[i] for i in mb["env_index"].tolist()], rel=1e-5)
    assert all(abs(a) > 0.1 for a in got)
    # ratio 1 (the stored log-probs are the starting weights'): the loss is -mean(advantage)
    expected = -sum(want[i] * steps[i] for i in want) / sum(steps.values())
    assert abs(expected) > 0.01
    assert metrics["loss/loss_policy"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert metrics["grpo/groups_kept"] == pytest.approx(2 / 3)
    after = worker.get_weights()
    assert not torch.equal(before["actor_mean.0.weight"], after["actor_mean.0.weight"])


def test_maniskill_pushcube_ppo_openvla_oft_tiny_runs_token_level_ppo(tmp_path, capsys):
    """The OFT PPO config (per-token ratios, the privileged critic on the simulator state, rgb
    + wrist camera) runs an update on real ManiSkill envs: its learner reads the rollout's
    per-token log-probs."""
    rc = train(["--config-name", "maniskill_pushcube_ppo_openvla_oft_tiny", "cluster=inprocess",
                "runner.num_iterations=1", "runner.rollout_steps=2", "env.num_envs=2",
                "runner.eval_interval=0", "env.max_episode_steps=16",
                "algorithm.critic_warmup=0",  # (the config's first updates: the critic alone)
                "runner.progress_bar=false", f"runner.log_dir={tmp_path}"])
    assert rc == 0
    # 2 envs x 2 policy calls x chunks of 8 env steps
    assert "done: 1 iterations, 32 env steps" in capsys.readouterr().out
    log = next(tmp_path.glob("*/*/train.log")).read_text()
    assert "vloss" in log and "kl" in log
