"""LIBERO env steps per second: one process, and two processes stepped together.

Cases (per case, the 1- and 2-process envs are alive at once and timed in interleaved rounds,
since this machine's speed drifts; one case at a time, as each rgb process takes ~1-2 GB):
  rgb standard  LIBERO's look: agent view + wrist at --size px, 4x MSAA, reflections
  rgb fast      the same cameras without MSAA and reflections (env.render_quality=fast)
  state         physics only, nothing rendered
each with 1 env process and with 2 (m2flow's LIBERO adapter: one MuJoCo process per env,
stepped in parallel by GymVectorEnv). Random actions; episodes reset as they end.

    python bench/libero_throughput.py [--suite libero_spatial] [--size 128] [--steps 30]
                                      [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import record
import torch

from m2flow.envs import env_config, make_env

CASES = {  # name -> (obs_mode, render_quality)
    "rgb standard": ("rgb", "standard"),
    "rgb fast": ("rgb", "fast"),
    "state": ("state", "standard"),
}
PROCESSES = (1, 2)
WARMUP_STEPS = 5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", default="libero_spatial")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rates: dict = {}
    for case, (mode, quality) in CASES.items():
        envs = {}
        try:
            for n in PROCESSES:
                envs[n] = make_env(env_config(
                    name=f"LIBERO/{args.suite}", num_envs=n, obs_mode=mode,
                    image_size=args.size, render_quality=quality,
                ))
                envs[n].reset(seed=list(range(n)))
                rates[case, n] = []
            for rnd in range(args.rounds + 1):
                for n, env in envs.items():
                    steps = WARMUP_STEPS if rnd == 0 else args.steps
                    t = time.perf_counter()
                    for _ in range(steps):
                        env.step(torch.rand(n, 7) * 2 - 1)
                    if rnd > 0:
                        rates[case, n].append(steps * n / (time.perf_counter() - t))
        finally:
            for env in envs.values():
                env.close()
    print(f"\nLIBERO/{args.suite}, {args.size} px, {args.rounds} interleaved rounds of "
          f"{args.steps} steps, {os.cpu_count()} CPUs, MUJOCO_GL=egl")
    print(f"{'case':<14}{'1 process':>12}{'2 processes':>14}{'2 vs 1':>9}{'vs rgb standard':>17}")
    base = statistics.median(rates["rgb standard", 1])
    rows = []
    for case in CASES:
        one, two = (statistics.median(rates[case, n]) for n in PROCESSES)
        print(f"{case:<14}{one:>12.1f}{two:>14.1f}{two / one:>9.2f}{one / base:>17.2f}")
        rows += [(f"LIBERO/{args.suite} {case}", n, f"{n} process", r)
                 for n, r in zip(PROCESSES, (one, two))]
    print("(env steps per second, all envs together; median over rounds)")
    record.append("libero_throughput", rows)


if __name__ == "__main__":
    main()
