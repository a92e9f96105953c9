"""The replay buffer against plain references: a deque for the ring, a real env's auto-resets
for the transitions, the binomial bound for a two-source mix, and a checkpoint round trip."""

import collections
import math

import pytest
import torch
from tensordict import TensorDict

from m2flow import keys
from m2flow.embodied.workers.buffer import TrajectoryBuffer
from m2flow.embodied.algorithms.helpers.replay import MixedSampler, ReplayBuffer, transitions
from m2flow.envs import env_config, make_env


def rows(values) -> TensorDict:
    v = torch.as_tensor(values, dtype=torch.float32)
    return TensorDict({"x": v, "pix": v.to(torch.uint8)[:, None].expand(-1, 3)},
                      batch_size=[len(v)])


def test_the_ring_keeps_what_a_bounded_deque_keeps():
    gen = torch.Generator().manual_seed(0)
    buf, ref, next_value = ReplayBuffer(capacity=7), collections.deque(maxlen=7), 0
    for _ in range(20):
        n = int(torch.randint(0, 10, (1,), generator=gen))  # 0, and more than the capacity
        values = list(range(next_value, next_value + n))
        next_value += n
        buf.add(rows(values))
        ref.extend(values)
        assert len(buf) == len(ref)
        if ref:
            assert buf.stored()["x"].tolist() == list(ref)
            assert buf.stored()["pix"].dtype == torch.uint8
    assert buf.added == next_value
    drawn = buf.sample(500, generator=gen)["x"]
    assert set(drawn.tolist()) == set(ref)  # uniform over what is stored, nothing else


def test_transitions_are_true_s_a_r_s_prime_across_auto_resets():
    """Pendulum with 5-step episodes: every row's next obs is the step's real successor; where
    the episode ended (a time-out) it is the final obs, not the new episode's first."""
    env = make_env(env_config(name="gym/Pendulum-v1", num_envs=2, max_episode_steps=5))
    traj_buf, t_steps = TrajectoryBuffer(num_steps=12), 12
    batch = env.reset(seed=[0, 1])
    for t in range(t_steps):
        action = torch.full((2, 1), 0.5 * (t % 3 - 1))
        out = env.step(action)
        traj_buf.add(TensorDict({keys.OBS: batch[keys.OBS], keys.ACTION: action,
                                 keys.LOG_PROB: torch.zeros(2), keys.NEXT: out[keys.NEXT]},
                                batch_size=[2]))
        batch = out
    env.close()
    traj = traj_buf.data()  # (2, 12)
    buf = ReplayBuffer(capacity=100)
    buf.add(transitions(traj))
    flat = buf.stored()  # (24,) env 0's steps, then env 1's
    done = traj[keys.DONE]
    assert done.sum() == 4 and traj[keys.TRUNCATED].equal(done)  # two time-outs per env
    for i in range(2):
        for t in range(t_steps - 1):
            row, successor = flat[i * t_steps + t], traj[i, t + 1]
            same = torch.equal(row[keys.NEXT_OBS][keys.leaf(keys.STATE)],
                               successor[keys.STATE])
            assert same == (not bool(done[i, t])), (i, t)


def test_a_two_source_mix_takes_each_share_within_the_binomial_bound():
    online, demos = ReplayBuffer(50), ReplayBuffer(50)
    online.add(rows([0.0] * 50))
    demos.add(rows([1.0] * 50))
    ratio, batch, batches = 0.3, 7, 2000  # 7 * 0.3 = 2.1: a leftover row in every batch
    mix = MixedSampler({"online": online, "demos": demos}, {"online": 1 - ratio, "demos": ratio})
    gen = torch.Generator().manual_seed(1)
    per_batch = [int(mix.sample(batch, generator=gen)["x"].sum()) for _ in range(batches)]
    assert set(per_batch) == {2, 3}  # floor or ceil of 2.1, never more or fewer
    share = sum(per_batch) / (batch * batches)
    assert abs(share - ratio) < 4 * math.sqrt(ratio * (1 - ratio) / (batch * batches))


def test_a_mix_needs_ratios_for_exactly_its_sources():
    with pytest.raises(ValueError, match="sum to 1"):
        MixedSampler({"a": ReplayBuffer(2), "b": ReplayBuffer(2)}, {"a": 0.5, "b": 0.6})
    with pytest.raises(ValueError, match="ratios name"):
        MixedSampler({"a": ReplayBuffer(2)}, {"b": 1.0})


def test_a_restored_buffer_holds_the_saved_rows_and_samples_them_alike(tmp_path):
    buf = ReplayBuffer(capacity=6)
    for start in (0, 4, 8):  # wraps around: the ring's start is not row 0
        buf.add(rows(range(start, start + 4)))
    path = tmp_path / "replay.pt"
    torch.save(buf.state_dict(), path)
    again = ReplayBuffer(capacity=6)
    again.load_state_dict(torch.load(path, weights_only=False))
    assert again.stored()["x"].tolist() == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0] == \
        buf.stored()["x"].tolist()
    assert again.added == buf.added == 12
    draw = [b.sample(8, generator=torch.Generator().manual_seed(3))["x"] for b in (buf, again)]
    assert torch.equal(*draw)
    smaller = ReplayBuffer(capacity=4)
    smaller.load_state_dict(buf.state_dict())
    assert smaller.stored()["x"].tolist() == [8.0, 9.0, 10.0, 11.0]  # the newest kept
