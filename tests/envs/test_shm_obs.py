"""Observations through shared memory: bit-equal to the pickled messages for real ManiSkill
images, across an episode's end, a reset and a kill -9 of a simulator; no segment left in
/dev/shm and no resource-tracker complaint after close."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from m2flow.envs import env_config, make_env
from m2flow.envs.shm import MIN_BYTES, layout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHM_DIR = "/dev/shm"
EPISODE = 3  # steps: the rollout below crosses an episode's end (a final obs of its own)


def rgb_space(size: int) -> gym.spaces.Dict:
    return gym.spaces.Dict({"state": gym.spaces.Box(-np.inf, np.inf, (25,), np.float32),
                            "rgb": gym.spaces.Box(0, 255, (size, size, 3), np.uint8)})


def size_of(px: int) -> int:
    return px * px * 3


def test_auto_sends_images_and_keeps_state_vectors_in_messages():
    keys = lambda size, mode: sorted(f.key for f in layout(rgb_space(size), mode)[0])  # noqa: E731
    assert size_of(128) >= MIN_BYTES > size_of(64)
    assert keys(128, "auto") == ["rgb"]
    assert keys(64, "auto") == []
    assert keys(64, "on") == ["rgb", "state"]
    assert keys(128, "off") == []
    fields, nbytes = layout(rgb_space(128), "on")
    assert [f.offset % 64 for f in fields] == [0, 0] and nbytes >= size_of(128) + 100


def segments() -> set:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"m2flow-{os.getpid()}-")}


def mapped(slots) -> list:
    """Per env, whether its process has its block mapped."""
    return [name is not None and name in Path(f"/proc/{pid}/maps").read_text()
            for pid, name in zip(slots.pids, slots.shm_names)]


def rollout(mode: str) -> dict:
    """PushCube rgb 64 px, 2 envs: steps across an episode's end, a reset, a kill -9 of env 1
    and steps after its restart; every observation the env returned, and its blocks."""
    cfg = env_config(name="ManiSkill/PushCube-v1", num_envs=2, obs_mode="rgb", image_size=64,
                     max_episode_steps=EPISODE, shared_memory=mode)
    env = make_env(cfg)
    gen = torch.Generator().manual_seed(0)
    act = lambda: torch.rand(2, env.spec.action_dim, generator=gen) * 2 - 1  # noqa: E731
    slots = env._impl.slots
    try:
        before = [env.reset(seed=[0, 1])] + [env.step(act()) for _ in range(EPISODE + 1)]
        before += [env.reset(seed=[5, 6]), env.step(act())]
        os.kill(slots.pids[1], signal.SIGKILL)
        after = [env.step(act()) for _ in range(3)]
        blocks = dict(names=slots.shm_names, keys=slots.shared_keys, restarts=slots.restarts,
                      mapped=mapped(slots))
    finally:
        env.close()
    return dict(before=before, after=after, left=segments(), **blocks)


@pytest.fixture(scope="module")
def runs() -> dict:
    return {mode: rollout(mode) for mode in ("on", "off")}


def assert_equal(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        for key in ("obs", "next"):
            if key not in w.keys():
                continue
            for leaf in ("rgb", "state"):
                assert torch.equal(g[key, leaf] if key == "obs" else g[key, "obs", leaf],
                                   w[key, leaf] if key == "obs" else w[key, "obs", leaf])


def test_shared_memory_observations_equal_the_pickled_ones(runs):
    assert [set(k) for k in runs["on"]["keys"]] == [{"state", "rgb"}] * 2
    assert_equal(runs["on"]["before"], runs["off"]["before"])
    ended = runs["on"]["before"][EPISODE]
    assert ended["next", "truncated"].all()  # its final obs and the new episode's differ
    assert not torch.equal(ended["obs", "rgb"], ended["next", "obs", "rgb"])


def test_a_restarted_simulator_sends_through_its_block_again(runs):
    on, off = runs["on"], runs["off"]
    assert on["restarts"] == off["restarts"] == 1
    assert on["mapped"] == [True, True]  # the replacement attached to env 1's block
    assert on["after"][0]["next", "discarded"].tolist() == [False, True]
    assert_equal(on["after"], off["after"])  # the replacement reset with the same seed
    assert not torch.equal(on["after"][-1]["obs", "rgb"][1], on["after"][0]["obs", "rgb"][1])


def test_closed_slots_leave_no_segment(runs):
    names = runs["on"]["names"]
    assert all(names) and len(set(names)) == 2
    assert runs["on"]["left"] == set() and not any(os.path.exists(f"{SHM_DIR}/{n}") for n in names)


def test_off_keeps_the_pickled_path(runs):
    assert runs["off"]["keys"] == [(), ()] and runs["off"]["names"] == [None, None]


class NoiseEnv(gym.Env):
    """A 128 px image of noise from its seed; cheap (no simulator)."""

    observation_space = rgb_space(128)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._obs(), {}

    def step(self, action):
        return self._obs(), 0.0, False, False, {}

    def _obs(self):
        return {"state": self.np_random.random(25, np.float32),
                "rgb": self.np_random.integers(0, 256, (128, 128, 3), np.uint8)}


SCRIPT = f"""
import os, signal, sys
sys.path.insert(0, {ROOT!r})
import numpy as np
from m2flow.envs.procs import RESTART_SEED_STRIDE, ProcessSlots
from tests.envs.test_shm_obs import NoiseEnv, mapped
if __name__ == "__main__":
    slots = ProcessSlots([NoiseEnv] * 2)  # auto: rgb through the blocks, state in messages
    slots.reset([0, 1], [None, None])
    os.kill(slots.pids[0], signal.SIGKILL)
    slots.step_async(np.zeros((2, 1), np.float32))
    out = slots.step_wait()
    names, attached = slots.shm_names, mapped(slots)
    slots.close()
    fresh = NoiseEnv().reset(seed=RESTART_SEED_STRIDE)[0]  # the seed its restart used
    print(slots.shared_keys, slots.restarts, out[0].discarded, attached,
          all(np.array_equal(out[0].obs[k], fresh[k]) for k in fresh),
          [os.path.exists("/dev/shm/" + n) for n in names])
"""


def test_a_killed_simulator_leaks_no_segment_and_no_tracker_warning(tmp_path):
    # the resource tracker (a process of its own) warns at exit about a segment it still
    # tracks, or one unlinked twice: run the slots in a fresh interpreter that then exits
    (tmp_path / "main.py").write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(tmp_path / "main.py")], capture_output=True,
                         text=True, check=True, timeout=120)
    want = "[('rgb',), ('rgb',)] 1 True [True, True] True [False, False]"
    assert out.stdout.splitlines()[-1] == want, out.stderr
    assert "resource_tracker" not in out.stderr and "leaked" not in out.stderr, out.stderr
