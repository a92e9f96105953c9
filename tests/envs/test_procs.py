"""Simulator processes: forked from a fork server that preloads what they share, one thread
each, and replaced (from the same server, or a new one if it died) after a kill -9 so that the
replacement steps like a fresh env."""

import functools
import importlib.util
import os
import signal
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch

from m2flow.envs import env_config, make_env
from m2flow.envs import libero, maniskill
from m2flow.envs.procs import RESTART_SEED_STRIDE, EnvRecipe, ProcessSlots

PROBE, MAIN_PROBE = "wave", "poplib"  # stdlib modules nothing in m2flow or torch imports
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ProbeEnv(gym.Env):
    """Observes what its process found when it built the env: [the probe module imported
    (by the server), the main probe imported (by the parent's __main__), OMP_NUM_THREADS,
    torch threads]."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float64)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def __init__(self):
        self.facts = np.array([PROBE in sys.modules, MAIN_PROBE in sys.modules,
                               float(os.environ.get("OMP_NUM_THREADS", "nan")),
                               torch.get_num_threads()])

    def reset(self, *, seed=None, options=None):
        return self.facts, {}

    def step(self, action):
        return self.facts, 0.0, False, False, {}


def probe(recipe) -> np.ndarray:
    slots = ProcessSlots([recipe])
    try:
        return slots.reset([0], [None])[0]
    finally:
        slots.close()


def test_env_processes_start_with_the_servers_modules_and_one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the server sets its own before its imports
    assert PROBE not in sys.modules
    with_probe = probe(EnvRecipe(ProbeEnv, preload=(PROBE,)))
    without = probe(EnvRecipe(ProbeEnv))
    assert with_probe.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert without.tolist() == [0.0, 0.0, 1.0, 1.0]  # the probe came from the server


MAIN = f"""
import {MAIN_PROBE}, sys  # the env process must not import this script (its parent's __main__)
sys.path.insert(0, {ROOT!r})
from m2flow.envs.procs import EnvRecipe
from tests.envs.test_procs import ProbeEnv, probe
if __name__ == "__main__":
    print(probe(EnvRecipe(ProbeEnv)).tolist())
"""


def test_env_processes_do_not_import_the_parents_main_script(tmp_path):
    # a Ray worker's or the CLI's __main__ imports half the world; a forkserver child re-imports
    # its parent's __main__ unless told not to
    (tmp_path / "main.py").write_text(MAIN)
    out = subprocess.run([sys.executable, str(tmp_path / "main.py")], capture_output=True,
                         text=True, check=True)
    assert out.stdout.splitlines()[-1] == "[0.0, 0.0, 1.0, 1.0]", out.stderr


@pytest.mark.parametrize("preload", [maniskill.PRELOAD, libero.PRELOAD])
def test_every_preloaded_module_exists(preload):
    # the fork server skips a module it cannot import without a word: a typo would silently
    # give every env process its own copy again
    if preload is libero.PRELOAD:
        libero.prepare()  # libero reads its config at import, as the server does after it
    assert [m for m in preload if importlib.util.find_spec(m) is None] == []


def fresh_rollout(seed: int, actions: list) -> list:
    """env.step observations of a never-restarted PushCube env from ``seed``."""
    env = make_env(env_config(name="ManiSkill/PushCube-v1", num_envs=1))
    try:
        obs = [env.reset(seed=[seed])["obs", "state"][0]]
        obs += [env.step(a[1:])["obs", "state"][0] for a in actions]
        return obs
    finally:
        env.close()


@pytest.mark.parametrize("kill_server", [False, True], ids=["process", "process+server"])
def test_a_killed_simulator_is_replaced_and_steps_like_a_fresh_env(kill_server):
    env = make_env(env_config(name="ManiSkill/PushCube-v1", num_envs=2))
    gen = torch.Generator().manual_seed(0)
    actions = [torch.rand(2, env.spec.action_dim, generator=gen) * 2 - 1 for _ in range(4)]
    try:
        slots = env._impl.slots
        env.reset(seed=[0, 1])
        env.step(actions[0])
        server = slots.server.pid
        os.kill(slots.pids[1], signal.SIGKILL)
        if kill_server:
            os.kill(server, signal.SIGKILL)
        out = env.step(actions[0])
        assert out["next", "discarded"].tolist() == [False, True]
        assert slots.restarts == 1
        assert (slots.server.pid != server) == kill_server
        restarted = [out["obs", "state"][1]] + [env.step(a)["obs", "state"][1] for a in actions]
    finally:
        env.close()
    seed = (1 + RESTART_SEED_STRIDE) & 0x7FFFFFFF  # the seed its restart used
    expected = fresh_rollout(seed, actions)
    for got, want in zip(restarted, expected):
        torch.testing.assert_close(got, want)
    assert not torch.equal(restarted[-1], restarted[0])  # it moved


@pytest.mark.parametrize("answer_unread", [False, True], ids=["idle", "answer-unread"])
def test_a_simulator_whose_parent_is_gone_exits_quietly(answer_unread):
    """A run that ends (Ctrl-C, a failure) kills its env worker, the parent of the simulator
    processes, whose end of each pipe then closes. A simulator exits with code 0, printing
    nothing (a traceback would reach the terminal of the run that is ending); with an answer
    the parent never read, its next read fails with ECONNRESET instead of an end of file."""
    slots = ProcessSlots([functools.partial(gym.make, "CartPole-v1")])
    proc, conn = slots._procs[0], slots._conns[0]
    try:
        slots.reset([0], [None])
        if answer_unread:
            slots.step_async(np.array([1]))
            assert conn.poll(30)  # its answer waits, unread
        conn.close()  # as a killed parent's end of the pipe closes
        proc.join(timeout=30)
        assert proc.exitcode == 0
    finally:
        slots.close()
