"""Embodied GRPO's advantages and group filter against hand-computed examples (issue 5)."""

import math

import pytest
import torch
from tensordict import TensorDict

from m2flow.embodied.algorithms import AlgorithmError
from m2flow.embodied.algorithms.grpo import GRPO, GRPOConfig, grpo_loss, keep_groups
from m2flow.runs.rl import group_advantages


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
        keep_groups(torch.zeros(6).bool(), group_size=4)


def test_prepare_gives_each_first_episode_its_group_advantage_and_drops_the_rest():
    grpo = GRPO(GRPOConfig(group_size=2), action_dim=2, seed=0)
    n, t = 4, 4
    reward = torch.zeros(n, t)
    done = torch.zeros(n, t, dtype=torch.bool)
    reward[0, 1], done[0, 1] = 1.0, True  # group 0: env 0 succeeds at t=1, env 1 never ends
    done[2, 2] = done[3, 3] = True        # group 1: both fail -> filtered out
    traj = TensorDict({"step": torch.arange(n * t).reshape(n, t),
                       "next": {"reward": reward, "done": done, "success": reward > 0}},
                      batch_size=[n, t])
    batch, stats = grpo.prepare(None, traj, iteration=0, staleness=0)
    assert traj["advantage"][:, 0].tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)
    assert traj["valid"].tolist() == [[True, True, False, False], [True] * 4,
                                      [False] * 4, [False] * 4]
    assert batch["step"].tolist() == [0, 1, 4, 5, 6, 7]  # env 0's episode, all of env 1
    assert batch["advantage"].tolist() == pytest.approx([1.0] * 2 + [-1.0] * 4, abs=1e-5)
    assert stats["grpo/groups_kept"] == 0.5 and stats["grpo/episode_success_once"] == 0.25
    assert stats["grpo/groups_mixed"] == 0.5


def test_groups_mixed_counts_the_groups_sampling_split_whatever_the_filter_keeps():
    # three groups of 3: one split (1 of 3 succeed), one all-success, one all-failure; the
    # filter is off, so every group is kept, but only one in three says which actions helped
    grpo = GRPO(GRPOConfig(group_size=3, filter_low=-1, filter_high=2), action_dim=1, seed=0)
    n, t = 9, 2
    success = torch.tensor([1, 0, 0, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
    done = torch.zeros(n, t, dtype=torch.bool)
    done[:, 1] = True
    reward = torch.zeros(n, t)
    reward[:, 1] = success.float()
    traj = TensorDict({"next": {"reward": reward, "done": done,
                                "success": success[:, None] & done}}, batch_size=[n, t])
    _, stats = grpo.prepare(None, traj, iteration=0, staleness=0)
    assert stats["grpo/groups_kept"] == 1.0
    assert stats["grpo/groups_mixed"] == pytest.approx(1 / 3)


def test_episode_success_at_end_is_the_first_episodes_last_flag():
    # env 0: F, T, T, F and done at t=3 (reached, then left), its next episode succeeds;
    # env 1: F, F, F, T, done at t=3; env 2 (never done): T at t=1, F at t=5; env 3: chunks
    # whose success_at_end says the episode left the goal within its last chunk
    F, T = False, True
    success = torch.tensor([[F, T, T, F, T, T], [F, F, F, T, F, F], [F, T, F, F, F, F],
                            [F, T, T, T, F, F]])
    done = torch.zeros(4, 6, dtype=torch.bool)
    done[0, 3] = done[1, 3] = done[3, 2] = True
    at_end = success.clone()
    at_end[3, 2] = False  # env 3's chunk at t=2: success at some step, not at its last
    traj = TensorDict({"next": {"reward": torch.zeros(4, 6), "done": done, "success": success,
                                "success_at_end": at_end}}, batch_size=[4, 6])
    grpo = GRPO(GRPOConfig(group_size=2, filter_low=-1, filter_high=2), action_dim=1, seed=0)
    _, stats = grpo.prepare(None, traj, iteration=0, staleness=0)
    assert stats["grpo/episode_success_once"] == 1.0
    assert stats["grpo/episode_success_at_end"] == 0.25  # env 1 only


class _TokenPolicy:
    """Log-probs per token fixed by the test: the ratio is exp(new - old) by construction."""

    def __init__(self, token_log_prob):
        self.token_log_prob = token_log_prob

    def evaluate_actions(self, mb):
        tok = self.token_log_prob
        return TensorDict({"token_log_prob": tok, "log_prob": tok.sum(-1),
                           "entropy": torch.zeros(len(mb))}, batch_size=mb.batch_size)


@pytest.mark.parametrize("level,expected", [
    # token ratios (1.5, 1) with A=+1 -> (-1.2, -1) mean -1.1
    ("token", -1.1),
    # the action (both tokens) ratio 1.5 -> clipped -1.2
    ("action", -1.2),
    ("chunk", -1.2),
])
def test_grpo_loss_at_each_logprob_level_by_hand(level, expected):
    old = torch.zeros(1, 2)
    new = torch.tensor([[math.log(1.5), 0.0]])
    mb = TensorDict({"token_log_prob": old, "log_prob": old.sum(-1), "advantage": torch.ones(1)},
                    batch_size=[1])
    terms = grpo_loss(_TokenPolicy(new), mb, clip_coef=0.2, ent_coef=0.0, level=level,
                      action_dim=2)
    assert terms["loss_policy"].item() == pytest.approx(expected)


def test_token_level_without_token_log_probs_is_one_clear_error():
    mb = TensorDict({"log_prob": torch.zeros(1), "advantage": torch.ones(1)}, batch_size=[1])
    with pytest.raises(ValueError, match="logprob_level='token' needs per-token log-probs"):
        grpo_loss(_TokenPolicy(torch.zeros(1, 2)), mb, clip_coef=0.2, ent_coef=0.0, level="token")


def test_reset_groups_and_config_checks():
    assert GRPO.reset_group_size(GRPOConfig(group_size=4)) == 4
    for bad, match in [(dict(group_size=1), "algorithm.group_size=1: must be >= 2"),
                       (dict(filter_low=0.5, filter_high=0.5), "algorithm.filter_low=0.5"),
                       (dict(logprob_level="tokens"), "algorithm.logprob_level='tokens'")]:
        with pytest.raises(AlgorithmError, match=match):
            GRPOConfig(**bad).validate()
    GRPOConfig(filter_low=-1.0, filter_high=2.0).validate()  # keep every group
