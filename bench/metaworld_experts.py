"""Meta-World's scripted experts through m2flow's env: success per task on the installed MuJoCo.

Every task of the suite, episodes from seeds 0 .. N-1 (the env's seeded initial states, as
evaluation uses them), Meta-World's expert (``metaworld.policies.ENV_POLICY_MAP``) acting on
the 39-dim state until its first success or the time limit. Prints one row per task (with
its difficulty in Seo et al.'s split) and the mean per level and overall; appends a row to
bench/results.csv (case: suite, limit and MuJoCo version; the figure: mean success in %).

    python bench/metaworld_experts.py [--suite MT50] [--episodes 10] [--max-steps 100]
"""

from __future__ import annotations

import argparse
import statistics
import time

import record

from m2flow.embodied.demos.metaworld import expert, run_episode
from m2flow.envs import env_config, make_env
from m2flow.envs.metaworld import DIFFICULTY, difficulty


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", default="MT50")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--max-steps", type=int, default=100)
    args = p.parse_args()
    import mujoco

    env = make_env(env_config(name=f"MetaWorld/{args.suite}", num_envs=1, obs_mode="state",
                              max_episode_steps=args.max_steps))
    rates, steps, start = {}, 0, time.perf_counter()
    try:
        for task, name in enumerate(env.task_names):
            policy = expert(name)
            demos = [run_episode(env, policy, seed, task) for seed in range(args.episodes)]
            rates[name] = sum(bool(d.success[-1]) for d in demos) / args.episodes
            steps += sum(len(d.actions) for d in demos)
            print(f"{name:30s} {difficulty(name):9s} {rates[name]:.2f}", flush=True)
    finally:
        env.close()
    seconds = time.perf_counter() - start
    for level in DIFFICULTY:
        got = [r for n, r in rates.items() if difficulty(n) == level]
        if got:
            print(f"{level:9s} {statistics.mean(got):.3f} ({len(got)} tasks)")
    mean = statistics.mean(rates.values())
    low = [n for n, r in rates.items() if r < 0.8]
    print(f"mean {mean:.3f} over {len(rates)} tasks x {args.episodes} episodes, limit "
          f"{args.max_steps} steps, MuJoCo {mujoco.__version__}; tasks below 0.8: {low or 'none'}; "
          f"{steps} env steps in {seconds:.0f} s ({steps / seconds:.0f} steps/s, expert included)")
    record.append("metaworld_experts", [(f"{args.suite} limit {args.max_steps} mujoco "
                                         f"{mujoco.__version__} success %", 1, "state",
                                         100 * mean)])


if __name__ == "__main__":
    main()
