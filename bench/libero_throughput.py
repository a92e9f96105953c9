"""LIBERO env steps per second by look (image size, render quality, cameras), and for one
process against two.

Looks (m2flow's LIBERO adapter, one MuJoCo process per env, random actions, episodes reset
as they end):
  rgb standard 128   LIBERO's look: agent view + wrist at 128 px, 4x MSAA, reflections
  rgb fast 128       the same cameras without MSAA and reflections (env.render_quality=fast)
  rgb standard 64    LIBERO's look at 64 px
  rgb fast 64        fast at 64 px, both cameras (libero_spatial_grpo_openvla_oft_tiny's look)
  rgb fast 128 agent fast, the agent view alone (env.wrist_camera=false;
                     libero_spatial_ppo_cnn's look)
  rgb fast 64 agent  the same at 64 px
  rgb fast 64 chunk 8  fast at 64 px, both cameras, stepped in action chunks of 8 (ChunkedEnv,
                     as the tiny OFT recipes step): a chunk's 7 inner steps render no frames
  state              physics only, nothing rendered

Two parts, each in interleaved rounds (this machine's speed drifts, and it is shared): first
every look with 1 process, all alive at once, so each look's ratio to rgb standard 128 comes
from the same minutes; then, one look at a time (each rgb process takes ~1-2 GB), the
``--pairs`` looks with 1 and with 2 processes (GymVectorEnv steps them in parallel).
``--frames DIR``: also writes each rgb look's first frames there as PNG (agent view | wrist).

    python bench/libero_throughput.py [--suite libero_spatial] [--steps 30] [--rounds 3]
                                      [--looks ...] [--pairs ...] [--frames DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import record
import torch

from m2flow.envs import env_config, make_env

LOOKS = {  # name -> LiberoEnvConfig settings
    "rgb standard 128": dict(obs_mode="rgb", image_size=128, render_quality="standard"),
    "rgb fast 128": dict(obs_mode="rgb", image_size=128, render_quality="fast"),
    "rgb standard 64": dict(obs_mode="rgb", image_size=64, render_quality="standard"),
    "rgb fast 64": dict(obs_mode="rgb", image_size=64, render_quality="fast"),
    "rgb fast 128 agent": dict(obs_mode="rgb", image_size=128, render_quality="fast",
                               wrist_camera=False),
    "rgb fast 64 agent": dict(obs_mode="rgb", image_size=64, render_quality="fast",
                              wrist_camera=False),
    "rgb fast 64 chunk 8": dict(obs_mode="rgb", image_size=64, render_quality="fast", chunk=8),
    "state": dict(obs_mode="state"),
}
BASE = "rgb standard 128"
PAIRS = ("rgb standard 128", "rgb fast 64", "rgb fast 128 agent", "state")
WARMUP_STEPS = 5


def rates(envs: dict, steps: int, rounds: int) -> dict:
    """Env steps/s (all of an env's processes together) of each env in ``envs``, per round:
    a warm-up round, then ``rounds`` rounds, each stepping every env ``steps`` times in turn."""
    out = {key: [] for key in envs}
    for rnd in range(rounds + 1):
        for key, env in envs.items():
            n, k = env.num_envs, getattr(env, "chunk", 1)
            shape = (n, 7) if k == 1 else (n, k, 7)
            t = time.perf_counter()
            for _ in range(-(-(WARMUP_STEPS if rnd == 0 else steps) // k)):
                env.step(torch.rand(shape) * 2 - 1)
            if rnd > 0:
                out[key].append(-(-steps // k) * k * n / (time.perf_counter() - t))
    return {key: statistics.median(r) for key, r in out.items()}


def build(suite: str, look: str, n: int):
    settings = dict(LOOKS[look])
    chunk = settings.pop("chunk", 1)
    env = make_env(env_config(name=f"LIBERO/{suite}", num_envs=n, **settings))
    if chunk > 1:
        from m2flow.envs.chunked import ChunkedEnv

        env = ChunkedEnv(env)
        env.chunk = chunk
    obs = env.reset(seed=list(range(n)))["obs"]
    return env, obs


def save_frames(folder: str, look: str, obs) -> None:
    """Env 0's first frames of ``look`` as ``folder/<look>.png``: agent view | wrist."""
    import numpy as np
    from PIL import Image

    frames = [obs[k][0].numpy() for k in ("rgb", "wrist_rgb") if k in obs.keys()]
    os.makedirs(folder, exist_ok=True)
    Image.fromarray(np.concatenate(frames, axis=1)).save(
        os.path.join(folder, look.replace(" ", "_") + ".png"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", default="libero_spatial")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--looks", nargs="+", default=list(LOOKS), choices=list(LOOKS))
    p.add_argument("--pairs", nargs="*", default=list(PAIRS), choices=list(LOOKS))
    p.add_argument("--frames", default=None, help="folder for each rgb look's first frames")
    args = p.parse_args()
    looks = [BASE] + [lk for lk in dict.fromkeys(args.looks + args.pairs) if lk != BASE]
    load = [os.getloadavg()[0]]
    envs = {}
    try:
        for look in looks:
            envs[look], obs = build(args.suite, look, 1)
            if args.frames and look != "state":
                save_frames(args.frames, look, obs)
        one = rates(envs, args.steps, args.rounds)
    finally:
        for env in envs.values():
            env.close()
    load.append(os.getloadavg()[0])
    pair = {}
    for look in args.pairs:
        envs = {}
        try:
            for n in (1, 2):
                envs[n] = build(args.suite, look, n)[0]
            pair[look] = rates(envs, args.steps, args.rounds)
        finally:
            for env in envs.values():
                env.close()
        load.append(os.getloadavg()[0])
    print(f"\nLIBERO/{args.suite}, {args.rounds} interleaved rounds of {args.steps} steps, "
          f"{os.cpu_count()} CPUs, load {min(load):.1f}-{max(load):.1f}, MUJOCO_GL=egl")
    print(f"{'look':<20}{'1 process':>11}{f'vs {BASE}':>22}{'2 processes':>13}{'2 vs 1':>8}")
    rows = []
    for look in looks:
        line = f"{look:<20}{one[look]:>11.1f}{one[look] / one[BASE]:>22.2f}"
        rows.append((f"LIBERO/{args.suite} {look}", 1, "1 process (all looks)", one[look]))
        if look in pair:
            a, b = pair[look][1], pair[look][2]
            line += f"{b:>13.1f}{b / a:>8.2f}"
            rows += [(f"LIBERO/{args.suite} {look}", n, f"{n} process (pair)", r)
                     for n, r in ((1, a), (2, b))]
        print(line)
    print("(env steps per second, all envs together; median over rounds; '2 processes' and "
          "'2 vs 1' from the second part)")
    record.append("libero_throughput", rows)


if __name__ == "__main__":
    main()
