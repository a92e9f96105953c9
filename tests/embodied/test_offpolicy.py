"""SAC's maths against hand-worked numbers and plain loops: the critics' target with a
termination against a time-out, the temperature's loss and the direction it moves alpha, the
actor's loss, and the Polyak update."""

import torch

from m2flow.embodied.algorithms.helpers.offpolicy import (
    actor_loss, polyak_update, soft_q_target, temperature_loss)


def test_a_time_out_bootstraps_and_a_termination_does_not():
    # three steps: mid-episode, terminated (goal reached), truncated (time limit)
    reward = torch.tensor([0.5, 1.0, 0.0])
    next_q1, next_q2 = torch.tensor([4.0, 4.0, 2.0]), torch.tensor([3.0, 5.0, 6.0])
    next_log_prob = torch.tensor([-2.0, -2.0, 1.0])
    terminated = torch.tensor([False, True, False])
    # by hand, alpha 0.1, gamma 0.99:
    #   0: 0.5 + 0.99 * (min(4, 3) - 0.1 * -2) = 0.5 + 0.99 * 3.2 = 3.668
    #   1: 1.0 (no bootstrap)
    #   2: 0.0 + 0.99 * (min(2, 6) - 0.1 * 1) = 0.99 * 1.9 = 1.881
    y = soft_q_target(reward, next_q1, next_q2, next_log_prob, terminated=terminated,
                      alpha=0.1, gamma=0.99)
    assert torch.allclose(y, torch.tensor([3.668, 1.0, 1.881]))


def test_the_temperature_rises_while_entropy_is_below_target_and_falls_above():
    target_entropy = -2.0  # -action_dim for 2 action dims
    for log_prob, direction in ((torch.tensor([3.0, 2.5]), +1),  # entropy -2.75 < -2
                                (torch.tensor([0.0, 1.0]), -1)):  # entropy -0.5 > -2
        log_alpha = torch.tensor(0.3, requires_grad=True)
        loss = temperature_loss(log_alpha, log_prob, target_entropy=target_entropy)
        # by hand: -exp(0.3) * mean(log_prob + target_entropy)
        expected = -torch.exp(torch.tensor(0.3)) * (log_prob + target_entropy).mean()
        assert torch.allclose(loss, expected)
        loss.backward()
        assert torch.sign(-log_alpha.grad) == direction  # a descent step moves log alpha so


def test_the_actor_loss_takes_the_smaller_critic():
    log_prob = torch.tensor([-1.0, 0.5], requires_grad=True)
    q1, q2 = torch.tensor([2.0, -1.0]), torch.tensor([1.0, 3.0])
    loss = actor_loss(log_prob, q1, q2, alpha=0.2)
    # by hand: mean(0.2 * -1 - 1, 0.2 * 0.5 - -1) = mean(-1.2, 1.1) = -0.05
    assert torch.allclose(loss, torch.tensor(-0.05))
    loss.backward()
    assert torch.allclose(log_prob.grad, torch.tensor([0.1, 0.1]))  # alpha / B


def test_polyak_matches_a_plain_loop_over_every_element():
    gen = torch.Generator().manual_seed(0)
    online = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]
    target = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]
    expected = [t.clone() for t in target]
    tau = 0.005
    for e, o in zip(expected, online):
        flat_e, flat_o = e.view(-1), o.view(-1)
        for i in range(flat_e.numel()):
            flat_e[i] = tau * flat_o[i] + (1 - tau) * flat_e[i]
    polyak_update(target, online, tau=tau)
    for t, e in zip(target, expected):
        assert torch.allclose(t, e, atol=1e-7)
    polyak_update(target, online, tau=1.0)  # a hard copy
    assert all(torch.equal(t, o) for t, o in zip(target, online))
