"""Several envs in one simulator process (``env.envs_per_process``): every env steps as it
would alone, observations through its own shared-memory block; a killed process discards the
episodes of its envs and of no other, and its envs restart like fresh ones."""

import os
import signal

import gymnasium as gym
import numpy as np
import pytest

from m2flow.envs.procs import RESTART_SEED_STRIDE, ProcessSlots

EPISODE = 3  # steps: the rollouts below cross episode ends (auto-resets inside a group)
PX = 96  # 27 KiB images: 'auto' sends them through shared memory


class WalkEnv(gym.Env):
    """A point that walks by its actions from a seeded start; its image paints the position,
    so a mixed-up env, block or step shows in both keys."""

    observation_space = gym.spaces.Dict({
        "state": gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
        "rgb": gym.spaces.Box(0, 255, (PX, PX, 3), np.uint8)})
    action_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos, self.t = self.np_random.normal(size=3).astype(np.float32), 0
        return self._obs(), {}

    def step(self, action):
        self.pos = self.pos + np.asarray(action, np.float32)
        self.t += 1
        return self._obs(), float(self.pos.sum()), False, self.t >= EPISODE, {}

    def _obs(self):
        img = np.full((PX, PX, 3), 0, np.uint8)
        img[..., :] = (np.abs(self.pos) * 40).astype(np.uint8) % 255
        img[self.t % PX, :, 0] = 255
        return {"state": self.pos.copy(), "rgb": img}


def plain_loop(seeds, actions):
    """The independent computation: each env alone in this process, reset and stepped by
    hand (auto-reset as the slots do), its obs, final obs and rewards."""
    out = []
    for i, seed in enumerate(seeds):
        env = WalkEnv()
        obs, rows = env.reset(seed=seed)[0], []
        for a in actions:
            final, reward, term, trunc, _ = env.step(a[i])
            obs = env.reset()[0] if term or trunc else final
            rows.append((obs, final, reward, trunc))
        out.append(rows)
    return out


def same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in ("state", "rgb"))


@pytest.mark.parametrize("k", [1, 2, 5], ids=["1-each", "2-each-uneven", "all-in-one"])
def test_grouped_envs_step_as_each_alone(k):
    seeds, n = [11, 12, 13, 14, 15], 5
    gen = np.random.default_rng(0)
    actions = [gen.uniform(-1, 1, (n, 3)).astype(np.float32) for _ in range(2 * EPISODE + 1)]
    want = plain_loop(seeds, actions)
    slots = ProcessSlots([WalkEnv] * n, envs_per_process=k)
    try:
        assert len(set(slots.pids)) == -(-n // k)  # ceil(n / k) processes
        assert slots.shared_keys == [("rgb",)] * n and len(set(slots.shm_names)) == n
        first = slots.reset(seeds, [None] * n)
        assert all(same(first[i], WalkEnv().reset(seed=s)[0]) for i, s in enumerate(seeds))
        for t, a in enumerate(actions):
            slots.step_async(a)
            got = slots.step_wait()
            for i in range(n):
                obs, final, reward, trunc = want[i][t]
                assert same(got[i].obs, obs) and same(got[i].final_obs, final), (t, i)
                assert got[i].reward == pytest.approx(reward) and got[i].truncated == trunc
                assert not got[i].discarded
    finally:
        slots.close()


def test_a_killed_group_discards_its_envs_only_and_restarts_them_fresh():
    seeds, n = [0, 1, 2, 3, 4], 5
    slots = ProcessSlots([WalkEnv] * n, envs_per_process=2)  # processes of envs 0-1, 2-3, 4
    try:
        slots.reset(seeds, [None] * n)
        step = np.full((n, 3), 0.5, np.float32)
        slots.step_async(step)
        before = slots.step_wait()
        pids = slots.pids
        assert pids[2] == pids[3] and len({pids[0], pids[2], pids[4]}) == 3
        os.kill(pids[2], signal.SIGKILL)
        slots.step_async(step)
        got = slots.step_wait()
        assert [r.discarded for r in got] == [False, False, True, True, False]
        assert slots.restarts == 1
        new = slots.pids
        assert new[2] == new[3] != pids[2]
        assert [new[i] for i in (0, 1, 4)] == [pids[i] for i in (0, 1, 4)]
        for i in (2, 3):  # a fresh episode from the restart's seed
            fresh = WalkEnv().reset(seed=seeds[i] + RESTART_SEED_STRIDE)[0]
            assert same(got[i].obs, fresh) and same(got[i].final_obs, fresh)
        for i in (0, 1, 4):  # untouched: two steps of 0.5 from their start
            start = WalkEnv().reset(seed=seeds[i])[0]["state"]
            np.testing.assert_allclose(before[i].obs["state"], start + 0.5, rtol=1e-6)
            np.testing.assert_allclose(got[i].obs["state"], start + 1.0, rtol=1e-6)
    finally:
        slots.close()


def test_a_group_that_cannot_be_restarted_names_its_envs():
    slots = ProcessSlots([WalkEnv] * 4, envs_per_process=2, max_restarts=0)
    try:
        slots.reset([0, 1, 2, 3], [None] * 4)
        os.kill(slots.pids[2], signal.SIGKILL)
        slots.step_async(np.zeros((4, 3), np.float32))
        with pytest.raises(Exception, match=r"env process 2 \(and env 3 with it\): its "
                                            r"simulator process was lost \(env.max_restarts=0\)"):
            slots.step_wait()
    finally:
        slots.close()


@pytest.mark.parametrize("cores, n, want", [(2, 16, 8), (16, 16, 1), (2, 5, 3), (4, 2, 1)])
def test_zero_gives_one_process_per_core(monkeypatch, cores, n, want):
    from m2flow.envs import procs

    monkeypatch.setattr(procs.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert procs.processes_for(n, 0) == want
    assert len(range(0, n, want)) == min(n, cores)  # as many processes as cores (or envs)


def pushcube_rollout(k: int, obs_mode: str) -> list:
    """4 PushCube envs, envs_per_process=k, across an auto-reset (5-step episodes): every
    observation (with rgb, the camera's frames too) and reward."""
    import torch

    from m2flow.envs import env_config, make_env

    env = make_env(env_config(name="ManiSkill/PushCube-v1", num_envs=4, max_episode_steps=5,
                              control_mode="pd_joint_delta_pos", obs_mode=obs_mode,
                              image_size=32, envs_per_process=k))
    gen = torch.Generator().manual_seed(0)
    try:
        assert len(set(env._impl.slots.pids)) == 4 // k
        out = [*env.reset(seed=[0, 1, 2, 3])["obs"].values()]
        for _ in range(7):
            td = env.step(torch.rand(4, env.spec.action_dim, generator=gen) * 2 - 1)
            out += [*td["obs"].values(), *td["next", "obs"].values(), td["next", "reward"]]
        return out
    finally:
        env.close()


@pytest.mark.parametrize("obs_mode", ["state", "rgb"])
def test_maniskill_envs_in_groups_simulate_and_render_as_one_per_process(obs_mode):
    """The episodes after an auto-reset too: each env draws them from its own seeds, not from
    its process's torch generator (which the envs of a group share)."""
    import torch

    grouped, alone = pushcube_rollout(2, obs_mode), pushcube_rollout(1, obs_mode)
    assert len(grouped) == len(alone) == (2 if obs_mode == "rgb" else 1) * 15 + 7
    for got, want in zip(grouped, alone):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
