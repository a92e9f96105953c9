"""Do observations cross from the simulator processes faster through shared memory than pickled?

Per case, the same envs twice, alive together, one with ``env.shared_memory=off`` (every
observation pickled through its process's pipe) and one with shared memory, timed in
interleaved rounds (this machine's speed drifts), random actions. Reports env steps/s and the
parent's time receiving a step's answers (``ProcessSlots._read``: recv, unpickle, copy out of
the blocks), per batched step and per env step, and the bytes a step's message carries. Cases:
  rgb        ManiSkill PushCube-v1 rgb 128 px, 8 envs (one 48 KiB image + 25 floats), auto
  libero     LIBERO libero_spatial rgb 128 px, 4 envs (two 48 KiB cameras + proprio), auto
  bare <px>  a stand-in env with no simulator and one fixed px x px x 3 image, 8 envs, 'on'
             (every array through the block, also those under auto's 16 KiB): the transfer
             alone, at 8 px (the size of a state vector) to 256 px

    python bench/obs_transfer.py [--cases rgb,libero,bare] [--rounds 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import functools
import os
import pickle
import statistics
import time

import gymnasium as gym
import numpy as np
import record
import torch

from m2flow.envs import env_config, make_env
from m2flow.envs.shm import IN_BLOCK
from m2flow.envs.vector import GymVectorEnv

ENVS = {  # case -> (env config, shared-memory mode compared with 'off')
    "rgb": (dict(name="ManiSkill/PushCube-v1", num_envs=8, obs_mode="rgb", image_size=128),
            "auto"),
    "libero": (dict(name="LIBERO/libero_spatial", num_envs=4, obs_mode="rgb", image_size=128),
               "auto"),
}
BARE_SIZES, BARE_ENVS, BARE_STEPS_X = (8, 32, 64, 128, 256), 8, 20  # bare: 20x the steps
WARMUP = 3


class BareEnv(gym.Env):
    """One fixed image, no simulator: steps cost only their transfer."""

    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def __init__(self, px: int):
        shape = (px, px, 3)
        self.observation_space = gym.spaces.Dict({"rgb": gym.spaces.Box(0, 255, shape, np.uint8)})
        self.obs = {"rgb": np.random.default_rng(px).integers(0, 256, shape, np.uint8)}

    def reset(self, *, seed=None, options=None):
        return self.obs, {}

    def step(self, action):
        return self.obs, 0.0, False, False, {}


def build(case: str, mode: str):
    if case.startswith("bare"):
        make = functools.partial(BareEnv, int(case.split()[1]))
        return GymVectorEnv([make] * BARE_ENVS, processes=True, max_episode_steps=None,
                            shared_memory=mode)
    return make_env(env_config(**ENVS[case][0], shared_memory=mode))


def timed_reads(env) -> list:
    """Makes the env's slots add their time in ``_read`` to the returned one-item list."""
    slots = getattr(env, "_impl", env).slots
    spent, read = [0.0], slots._read

    def timed(i, what):
        t = time.perf_counter()
        try:
            return read(i, what)
        finally:
            spent[0] += time.perf_counter() - t

    slots._read = timed
    return spent


def message_bytes(env) -> int:
    """Bytes of env 0's observation as it crosses the pipe (pickled; block arrays marked)."""
    shared = getattr(env, "_impl", env).slots.shared_keys[0]
    obs = env.reset(seed=list(range(env.num_envs)))["obs"][0]
    sent = {k: IN_BLOCK if k in shared else v.numpy() for k, v in obs.items()}
    return len(pickle.dumps(sent))  # the protocol multiprocessing sends with


def measure(case: str, mode: str, rounds: int, steps: int) -> dict:
    envs, rows = {}, {}
    try:
        for m in ("off", mode):
            envs[m] = build(case, m)
            rows[m] = dict(msg=message_bytes(envs[m]), rate=[], read=[], spent=timed_reads(envs[m]))
        n, dim = envs["off"].num_envs, envs["off"].spec.action_dim
        for rnd in range(rounds + 1):
            for m, env in envs.items():
                k = WARMUP if rnd == 0 else steps
                start, spent0 = time.perf_counter(), rows[m]["spent"][0]
                for _ in range(k):
                    env.step(torch.rand(n, dim) * 2 - 1)
                if rnd:
                    rows[m]["rate"].append(k * n / (time.perf_counter() - start))
                    rows[m]["read"].append((rows[m]["spent"][0] - spent0) / k)
    finally:
        for env in envs.values():
            env.close()
    return {m: dict(n=n, msg=r["msg"], rate=statistics.median(r["rate"]),
                    read_ms=1e3 * statistics.median(r["read"])) for m, r in rows.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="rgb,libero,bare")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps per round (bare: 20x)")
    args = p.parse_args()
    cases = []
    for c in args.cases.split(","):
        cases += [f"bare {px}" for px in BARE_SIZES] if c == "bare" else [c]
    results = {}
    for case in cases:
        bare = case.startswith("bare")
        mode = "on" if bare else ENVS[case][1]
        results[case] = measure(case, mode, args.rounds, args.steps * (BARE_STEPS_X if bare else 1))
        print(f"  {case}: {results[case]}", flush=True)
    print(f"\n{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}, {args.rounds} interleaved "
          f"rounds, median; read: the parent's time receiving one step's answers")
    print(f"{'case':<10}{'envs':>5}{'shm':>6}{'msg B':>8}{'steps/s':>9}{'read ms/step':>13}"
          f"{'us/env step':>12}{'vs off':>8}")
    rows = []
    for case, res in results.items():
        off = res["off"]["read_ms"]
        for m, r in res.items():
            print(f"{case:<10}{r['n']:>5}{m:>6}{r['msg']:>8}{r['rate']:>9.0f}{r['read_ms']:>13.3f}"
                  f"{1e3 * r['read_ms'] / r['n']:>12.1f}{r['read_ms'] / off:>8.2f}")
            rows.append((f"obs transfer {case}", r["n"], f"shared_memory={m}", r["rate"]))
    record.append("obs_transfer", rows)


if __name__ == "__main__":
    main()
