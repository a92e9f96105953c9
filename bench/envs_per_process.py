"""Do 16 CPU envs step faster in one process each, or several to a process?

The default job's envs (ManiSkill PushCube-v1 from state, pd_joint_delta_pos, 16 envs) built
once per ``env.envs_per_process`` value, all alive at once and timed in interleaved rounds
(this machine's speed drifts), random actions, episodes auto-resetting at their time limit.
Prints env steps/s per value (the median of the rounds) and its ratio to one env per process.

With ``--train N``, also the training loop itself: ``m2flow-train runner.num_iterations=N
runner.eval_interval=0`` with ``env.envs_per_process=1`` and ``=0`` (one process per core),
alternated ``--repeats`` times; seconds per iteration from the run's time breakdown.

    python bench/envs_per_process.py [--values 1 2 4 8 16] [--rounds 5] [--steps 100]
    python bench/envs_per_process.py --values 1 8 --train 12 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import record
import torch

from m2flow.envs import env_config, make_env

ENV = dict(name="ManiSkill/PushCube-v1", num_envs=16, control_mode="pd_joint_delta_pos",
           reward_mode="normalized_dense", ignore_terminations=True)
WARMUP = 10
ROOT = Path(__file__).resolve().parents[1]


def stepping(values: list, rounds: int, steps: int) -> dict:
    envs = {}
    try:
        for k in values:
            envs[k] = make_env(env_config(**ENV, envs_per_process=k))
            envs[k].reset(seed=list(range(ENV["num_envs"])))
        rates = {k: [] for k in values}
        n, dim = ENV["num_envs"], envs[values[0]].spec.action_dim
        gen = torch.Generator().manual_seed(0)
        for rnd in range(rounds + 1):
            for k, env in envs.items():
                todo = WARMUP if rnd == 0 else steps
                start = time.perf_counter()
                for _ in range(todo):
                    env.step(torch.rand(n, dim, generator=gen) * 2 - 1)
                if rnd:
                    rates[k].append(todo * n / (time.perf_counter() - start))
    finally:
        for env in envs.values():
            env.close()
    return {k: statistics.median(r) for k, r in rates.items()}


def training(iterations: int, repeats: int) -> dict:
    """s/it of the default job's first ``iterations``, per envs_per_process (1, 0)."""
    out = {1: [], 0: []}
    train = str(Path(sys.executable).with_name("m2flow-train"))
    for _ in range(repeats):
        for k in out:
            log = subprocess.run(
                [train, f"runner.num_iterations={iterations}", "runner.eval_interval=0",
                 "runner.progress_bar=false", f"env.envs_per_process={k}",
                 "run_name=bench_envs_per_process"],
                capture_output=True, text=True, cwd=ROOT,
                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
            m = re.search(r"wall ([0-9.]+) s/it", log.stdout + log.stderr)
            if not m:
                raise SystemExit(f"envs_per_process: m2flow-train failed:\n{log.stderr[-2000:]}")
            out[k].append(float(m.group(1)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--values", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=100, help="timed batched steps per round")
    p.add_argument("--train", type=int, default=0, metavar="N",
                   help="also time N iterations of the default job, 1 vs 0 (per core)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    rates = stepping(args.values, args.rounds, args.steps)
    print(f"\n{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}, {ENV['num_envs']} envs, "
          f"{args.rounds} interleaved rounds of {args.steps} steps, median")
    print(f"{'envs/process':>13}{'processes':>10}{'steps/s':>9}{'vs 1':>7}")
    base = rates.get(1)
    for k, r in rates.items():
        procs = -(-ENV["num_envs"] // k)
        print(f"{k:>13}{procs:>10}{r:>9.0f}{(r / base if base else float('nan')):>7.2f}")
    record.append("envs_per_process", [("PushCube state", ENV["num_envs"], f"k={k}", r)
                                       for k, r in rates.items()])
    if args.train:
        t = training(args.train, args.repeats)
        print(f"\ntraining loop, {args.train} iterations, s/it per repeat: "
              f"1 per process {t[1]}, one process per core {t[0]}; median ratio "
              f"{statistics.median(t[0]) / statistics.median(t[1]):.2f}")


if __name__ == "__main__":
    main()
