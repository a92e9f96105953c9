"""How many env steps and how much wall time does the default job need to reach its success
target? The README's first-run claim, measured: one run per seed (and per mode), one table.

Every run uses the same config (``maniskill_pushcube_ppo_mlp``: PushCube-v1 from state, PPO,
16 envs, stop at eval success >= 0.9 over 64 episodes, evaluated every 10 iterations) with
its seed and its mode's overrides:

- ``default``: the config as it is (what ``bash scripts/train.sh`` runs);
- ``full-eval`` / ``curtailed``: every evaluation runs all 64 episodes, or ends after the round
  (16 episodes) from which 0.9 is out of reach (``runner.eval_curtail``; curtailed is the
  default): the same stop decision, less evaluation;
- ``sequential`` / ``overlap``: ``runner.overlap_learner`` off / on.

The runs are sequential (minutes each on two cores). ``train s`` is the training loop (first
iteration to stop, evaluations included); ``command s`` adds start-up (Ray, simulators,
models) as ``m2flow-train`` would, without the interpreter's imports. The table is printed
as docs/results.md rows (date, commit, machine, command, figure). Run it before stopping
whenever ``embodied/``, ``envs/``, ``policies/`` or ``runs/`` changed:

    python bench/to_target.py                          # seeds 0 1 2, the default config
    python bench/to_target.py --seeds 0 --modes full-eval curtailed
    python bench/to_target.py --config maniskill_pickcube_ppo_mlp env.num_envs=8
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import time

from m2flow.cli.common import load_run_config
from m2flow.embodied.runner import EmbodiedRunner

MODES = {
    "default": [],
    "full-eval": ["runner.eval_curtail=false"],
    "curtailed": ["runner.eval_curtail=true"],
    "sequential": ["runner.overlap_learner=false"],
    "overlap": ["runner.overlap_learner=true"],
}


def train(config: str, mode: str, seed: int, overrides: list[str]) -> dict:
    """One run to the target (or ``runner.num_iterations``); the runner's summary plus the
    command's wall time."""
    t0 = time.perf_counter()
    cfg = load_run_config(config, [*MODES[mode], f"seed={seed}", "runner.progress_bar=false",
                                   f"run_name=bench_to_target_{mode}_s{seed}", *overrides])
    runner = EmbodiedRunner(cfg)
    try:
        result = runner.train()
    finally:
        runner.close()
    return {**result, "command_s": time.perf_counter() - t0}


def command(config: str, mode: str, seed: int, overrides: list[str]) -> str:
    """The m2flow-train command line a row stands for."""
    name = [] if config == "maniskill_pushcube_ppo_mlp" else ["--config-name", config]
    return shlex.join(["m2flow-train", *name, *MODES[mode], f"seed={seed}", *overrides])


def machine() -> str:
    import psutil

    return (f"{platform.processor() or platform.machine()} {os.cpu_count()} vCPU "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB, no GPU")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="maniskill_pushcube_ppo_mlp")
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["default"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    rows = [(mode, seed, train(args.config, mode, seed, args.overrides))
            for mode in args.modes for seed in args.seeds]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    date, where = datetime.date.today().isoformat(), machine()
    print(f"\n{args.config} {' '.join(args.overrides)}: to runner.stop_at_success")
    print("| date | commit | machine | command | iterations | env steps | eval success "
          "| train s | of it eval s | command s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, seed, r in rows:
        print(f"| {date} | `{commit}` | {where} | `{command(args.config, mode, seed, args.overrides)}` "
              f"| {r['iterations']} | {r['env_steps']:,} | {r.get('eval/success_once', float('nan')):.3f} "
              f"| {r['wall_s']:.0f} | {r['eval_s']:.0f} | {r['command_s']:.0f} |")
    for mode in args.modes:
        mine = [r for m, _, r in rows if m == mode]
        steps = sorted(r["env_steps"] for r in mine)
        walls = sorted(r["wall_s"] for r in mine)
        print(f"{mode}: env steps {steps[0]:,}-{steps[-1]:,}, train {walls[0]:.0f}-{walls[-1]:.0f} s "
              f"over seeds {' '.join(map(str, args.seeds))}")


if __name__ == "__main__":
    main()
