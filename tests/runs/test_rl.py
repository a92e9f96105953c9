"""The RL maths both workloads share (m2flow.runs.rl), and both workloads' use of it, against
one example worked by hand.

Three groups of three samples (episodes of envs reset alike; completions of one prompt):

- ``[2, 0, 1]``: mean 1, population std sqrt(2/3) -> ``+sqrt(3/2), -sqrt(3/2), 0``;
- ``[3, 0, 0]``: mean 1, std sqrt(2) -> ``sqrt(2), -1/sqrt(2), -1/sqrt(2)``;
- ``[0.9, 0.9, 0.9]``: no signal -> exactly ``0, 0, 0``. The formula alone gives 0.056 here:
  float32's mean of three 0.9s is off by a rounding residue, and that residue over
  ``eps=1e-6`` is not small. The rule both workloads follow is exactly 0.
"""

import math

import pytest
import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.runs.rl import clipped_surrogate, clipped_terms, group_advantages, ratio_stats

VALUES = [2.0, 0.0, 1.0, 3.0, 0.0, 0.0, 0.9, 0.9, 0.9]
BY_HAND = [math.sqrt(1.5), -math.sqrt(1.5), 0.0,
           math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2),
           0.0, 0.0, 0.0]
EPS = 1e-6


def test_the_formula_alone_leaves_a_residue_in_the_constant_group():
    """The example can fail: without the rule, the constant group would not be 0."""
    g = torch.tensor(VALUES[6:]).reshape(1, 3)
    naive = (g - g.mean(1, keepdim=True)) / (g.std(1, unbiased=False, keepdim=True) + EPS)
    assert naive.abs().min() > 0.01


def test_shared_group_advantages_by_hand():
    adv = group_advantages(torch.tensor(VALUES), 3, EPS)
    torch.testing.assert_close(adv, torch.tensor(BY_HAND), rtol=1e-5, atol=1e-5)
    assert torch.equal(adv[6:], torch.zeros(3))
    with pytest.raises(ValueError, match="9 samples do not split into groups of 4"):
        group_advantages(torch.tensor(VALUES), 4)


def test_embodied_grpo_gives_each_episode_the_hand_worked_advantage():
    """Nine envs in groups of 3, each env's first episode ending at t=0 with return VALUES[i];
    the filter is opened so every group stays."""
    from m2flow.embodied.algorithms.grpo import GRPO, GRPOConfig

    grpo = GRPO(GRPOConfig(group_size=3, filter_low=-1.0, filter_high=2.0), action_dim=1, seed=0)
    n, t = len(VALUES), 2
    reward = torch.zeros(n, t)
    reward[:, 0] = torch.tensor(VALUES)
    done = torch.zeros(n, t, dtype=torch.bool)
    done[:, 0] = True
    traj = TensorDict({"step": torch.arange(n * t).reshape(n, t),
                       "next": {"reward": reward, "done": done, "success": reward > 0}},
                      batch_size=[n, t])
    grpo.add_group_advantages(traj)
    adv = traj[keys.ADVANTAGE][:, 0]
    torch.testing.assert_close(adv, torch.tensor(BY_HAND), rtol=1e-5, atol=1e-5)
    assert torch.equal(adv[6:], torch.zeros(3))


def test_reasoning_grpo_gives_each_completion_the_hand_worked_advantage():
    """Three prompts with three completions each, scored VALUES, one group per prompt as the
    learner scores them."""
    from m2flow.reasoning.grpo import completion_advantages

    adv = torch.cat([completion_advantages(torch.tensor(VALUES[i:i + 3]), EPS)
                     for i in range(0, 9, 3)])
    torch.testing.assert_close(adv, torch.tensor(BY_HAND), rtol=1e-5, atol=1e-5)
    assert torch.equal(adv[6:], torch.zeros(3))


def test_clipped_objective_by_hand_in_both_workloads():
    """Ratios 1.5 (A=+1: clipped to 1.2 -> -1.2), 0.5 (A=-1: clipped to 0.8 -> 0.8),
    1.1 (A=+2: inside the clip -> -2.2); clip 0.2. Embodied: the mean, -2.6 / 3; reasoning:
    the sum over tokens, -2.6. approx_kl per ratio: r - 1 - log r."""
    from m2flow.reasoning.grpo import token_loss

    ratio = torch.tensor([1.5, 0.5, 1.1])
    adv = torch.tensor([1.0, -1.0, 2.0])
    torch.testing.assert_close(clipped_terms(ratio, adv, 0.2), torch.tensor([-1.2, 0.8, -2.2]))
    torch.testing.assert_close(clipped_surrogate(ratio.log(), adv, 0.2), torch.tensor(-2.6 / 3))
    kl = [r - 1 - math.log(r) for r in (1.5, 0.5, 1.1)]
    stats = ratio_stats(ratio.log(), 0.2)
    assert stats["approx_kl"].item() == pytest.approx(sum(kl) / 3, rel=1e-5)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 3)
    # reasoning: one completion per ratio, one token each, each its own advantage
    old = torch.zeros(3, 1)
    loss, sums = token_loss(ratio.log()[:, None], old, adv, torch.ones(3, 1, dtype=torch.bool), 0.2)
    assert loss.item() == pytest.approx(-2.6, rel=1e-6)
    assert sums["approx_kl"].item() == pytest.approx(sum(kl), rel=1e-5)
    assert sums["clip_fraction"].item() == 2.0
