import torch

from m2flow.runs.rl import gae


def gae_reference(reward, value, next_value, terminated, done, gamma, lam):
    """Plain per-env, per-step loop (cleanRL's recursion, written out)."""
    n, t_len = reward.shape
    adv = torch.zeros(n, t_len)
    for i in range(n):
        running = 0.0
        for t in reversed(range(t_len)):
            bootstrap = 0.0 if terminated[i, t] else float(next_value[i, t])
            delta = float(reward[i, t]) + gamma * bootstrap - float(value[i, t])
            running = delta + (0.0 if done[i, t] else gamma * lam * running)
            adv[i, t] = running
    return adv


def test_gae_matches_plain_loop_with_terminations_and_truncations():
    g = torch.Generator().manual_seed(0)
    n, t_len = 3, 17
    reward, value, next_value = (torch.randn(n, t_len, generator=g) for _ in range(3))
    terminated = torch.rand(n, t_len, generator=g) < 0.15
    truncated = (torch.rand(n, t_len, generator=g) < 0.15) & ~terminated
    done = terminated | truncated
    assert terminated.any() and truncated.any()

    adv, ret = gae(reward, value, next_value, terminated, done, gamma=0.9, gae_lambda=0.8)

    ref = gae_reference(reward, value, next_value, terminated, done, 0.9, 0.8)
    torch.testing.assert_close(adv, ref)
    torch.testing.assert_close(ret, ref + value)


def test_truncation_bootstraps_but_termination_does_not():
    one = torch.ones(1, 1)
    kw = dict(gamma=0.5, gae_lambda=1.0)
    truncated, _ = gae(one, 0 * one, 2 * one, one < 0, one > 0, **kw)
    terminated, _ = gae(one, 0 * one, 2 * one, one > 0, one > 0, **kw)
    assert truncated.item() == 2.0  # 1 + 0.5 * 2
    assert terminated.item() == 1.0
