"""Embodied GRPO's advantages and group filter against hand-computed examples (issue 5)."""

import math

import pytest
import torch

from m2flow.embodied.grpo import group_advantages, keep_groups


def test_advantages_by_hand():
    # group 1: returns 1, 0, 0, 1 -> mean 0.5, population std 0.5 -> +-1
    # group 2: returns 3, 0, 0, 0 -> mean 0.75, std sqrt(3)*0.75 -> 3/sqrt(3), -1/sqrt(3)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 0.0, 0.0, 0.0])
    adv = group_advantages(r, group_size=4, eps=0.0)
    s = math.sqrt(3)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, s, -1 / s, -1 / s, -1 / s]))
    assert torch.allclose(adv.reshape(2, 4).sum(1), torch.zeros(2), atol=1e-6)


def test_equal_returns_give_zero_advantage_not_nan():
    assert torch.equal(group_advantages(torch.ones(4), group_size=2), torch.zeros(4))


def test_filter_drops_all_success_and_all_failure_groups_and_bounds_are_config():
    success = torch.tensor([1, 1, 1, 1, 0, 0, 0, 1, 0]).bool()  # rates 1, 1/3, 1/3
    assert keep_groups(success, 3).tolist() == [False] * 3 + [True] * 6
    assert keep_groups(success, 3, low=0.5).tolist() == [False] * 9
    assert keep_groups(success, 3, low=-1.0, high=2.0).all()


def test_groups_must_divide_the_episodes():
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(torch.zeros(6), group_size=4)


def test_learner_gives_each_first_episode_its_group_advantage_and_masks_the_rest():
    from tensordict import TensorDict

    from m2flow.embodied.learner_worker import LearnerWorker
    from m2flow.embodied.ppo import PPOConfig
    from m2flow.envs import EnvSpec
    from m2flow.pipelines import RankResources, WorkerInfo
    from m2flow.policies import PolicyConfig

    spec = EnvSpec({"state": (3,)}, 2, (-1.0,) * 2, (1.0,) * 2, 4)
    info = WorkerInfo("learner", 0, 1, RankResources(0, 1.0, ()), "local")
    learner = LearnerWorker(info, PolicyConfig(name="mlp", hidden_sizes=[8]),
                            PPOConfig(name="grpo", group_size=2), spec, 0, 1)
    n, t = 4, 4
    reward = torch.zeros(n, t)
    done = torch.zeros(n, t, dtype=torch.bool)
    reward[0, 1], done[0, 1] = 1.0, True  # group 0: env 0 succeeds at t=1, env 1 never ends
    done[2, 2] = done[3, 3] = True        # group 1: both fail -> filtered out
    traj = TensorDict({"next": {"reward": reward, "done": done, "success": reward > 0}},
                      batch_size=[n, t])
    stats = learner._add_group_advantages(traj)
    assert traj["advantage"][:, 0].tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)
    assert traj["valid"].tolist() == [[True, True, False, False], [True] * 4,
                                      [False] * 4, [False] * 4]
    assert stats["grpo/groups_kept"] == 0.5
