"""How many env steps and how much wall time does the default job need to reach its success
target? The README's first-run claim, measured: one run per seed (and per mode), one table.

Every run uses the same config (``maniskill_pushcube_ppo_mlp``: PushCube-v1 from state, PPO,
16 envs, stop at eval success >= 0.9 over 64 episodes, evaluated every 10 iterations) with
its seed and its mode's overrides:

- ``default``: the config as it is (what ``bash scripts/train.sh`` runs);
- ``full-eval`` / ``curtailed``: every evaluation runs all 64 episodes, or ends after the round
  (16 episodes) from which 0.9 is out of reach (``runner.eval_curtail``; curtailed is the
  default): the same stop decision, less evaluation;
- ``sequential`` / ``overlap``: ``runner.overlap_learner`` off / on;
- ``confirmed``: a stop needs a second, larger evaluation to confirm it
  (``runner.stop_confirm_episodes=256``: its own 64 episodes first, then 192 more).
- ``gated`` / ``gated-every-2``: a scheduled evaluation runs only once the training success
  since the previous one reaches 0.7 (``runner.eval_gate``); every 10 iterations, or every 2
  (the stop then comes within 2 iterations of the policy reaching it, not 10).
- ``screened``: 16-episode evaluations (one round) behind a gate of 0.6, confirmed on 256:
  ``bench/stop_rules.py``'s cheapest honest rule for the default job.

``--score N`` scores each run's handed-over ``last.pt`` with ``m2flow-eval ... episodes=N
seed=0`` (the fixed initial states every policy is scored on): the figure a stop must not
overstate.

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
    "confirmed": ["runner.stop_confirm_episodes=256"],
    "gated": ["runner.eval_gate=0.7"],
    "gated-every-2": ["runner.eval_gate=0.7", "runner.eval_interval=2"],
    "screened": ["runner.eval_episodes=16", "runner.eval_gate=0.6"],
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


def score(checkpoint: str, episodes: int) -> dict:
    """``m2flow-eval checkpoint=<checkpoint> episodes=<episodes> seed=0``'s report."""
    import json
    import tempfile
    from pathlib import Path

    from m2flow.cli.eval import main as evaluate

    out = Path(tempfile.mkdtemp(prefix="to_target_eval_"))
    rc = evaluate([f"checkpoint={checkpoint}", f"episodes={episodes}", "seed=0",
                   "videos_per_task=0", f"output_dir={out}"])
    if rc != 0:
        raise SystemExit(f"to_target: m2flow-eval of {checkpoint} exited {rc}")
    return json.loads((out / "results.json").read_text())


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
    p.add_argument("--score", type=int, default=0, metavar="N",
                   help="score each run's last.pt on N fixed initial states (m2flow-eval)")
    p.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    rows = [(mode, seed, train(args.config, mode, seed, args.overrides))
            for mode in args.modes for seed in args.seeds]
    for _, _, r in rows:
        if args.score:
            rep = score(r["checkpoint"], args.score)
            r["scored"] = f"{rep['mean_success_once']:.3f} / {rep['mean_success_at_end']:.3f}"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    date, where = datetime.date.today().isoformat(), machine()
    print(f"\n{args.config} {' '.join(args.overrides)}: to runner.stop_at_success")
    print("| date | commit | machine | command | iterations | env steps | eval success "
          "| train s | of it eval s | command s | last.pt on the fixed states |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, seed, r in rows:
        print(f"| {date} | `{commit}` | {where} | `{command(args.config, mode, seed, args.overrides)}` "
              f"| {r['iterations']} | {r['env_steps']:,} | {r.get('eval/success_once', float('nan')):.3f} "
              f"| {r['wall_s']:.0f} | {r['eval_s']:.0f} | {r['command_s']:.0f} "
              f"| {r.get('scored', '-')} |")
    for mode in args.modes:
        mine = [r for m, _, r in rows if m == mode]
        steps = sorted(r["env_steps"] for r in mine)
        walls = sorted(r["wall_s"] for r in mine)
        print(f"{mode}: env steps {steps[0]:,}-{steps[-1]:,}, train {walls[0]:.0f}-{walls[-1]:.0f} s "
              f"over seeds {' '.join(map(str, args.seeds))}")


if __name__ == "__main__":
    main()
