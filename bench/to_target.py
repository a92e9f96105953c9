"""How long does the default job take to its success target, and what changes that? The job
trained once per mode in one run, wall time to the target side by side.

Every mode uses the same seed and config (maniskill_pushcube_ppo_mlp: PushCube-v1 from state,
PPO, 16 envs, stop at eval success >= 0.9 over 64 episodes, evaluated every 10 iterations) plus
its own overrides:

- ``full-eval``: every evaluation runs all 64 episodes (``runner.eval_curtail=false``);
- ``curtailed``: an evaluation ends after the round (16 episodes) from which 0.9 is out of
  reach (``runner.eval_curtail=true``, the default): the same stop decision, less evaluation;
- ``sequential`` / ``overlap``: ``runner.overlap_learner`` off / on (the env and rollout workers
  collect iteration k+1 with the previous weights while the learner trains on iteration k).

The runs are sequential (~5-15 minutes each here, too long to interleave); wall time counts
the training loop (``wall_s``: first iteration to stop) and, separately, the whole command
from launch (start-up included).

    python bench/to_target.py [--modes full-eval curtailed] [--config ...] [override ...]
"""

from __future__ import annotations

import argparse
import os
import time

from m2flow.cli import load_run_config
from m2flow.embodied.runner import EmbodiedRunner

MODES = {
    "full-eval": ["runner.eval_curtail=false"],
    "curtailed": ["runner.eval_curtail=true"],
    "sequential": ["runner.overlap_learner=false"],
    "overlap": ["runner.overlap_learner=true"],
}


def train(config: str, mode: str, overrides: list[str]) -> dict:
    t0 = time.perf_counter()
    cfg = load_run_config(config, [*MODES[mode], "runner.progress_bar=false",
                                   f"run_name=bench_to_target_{mode}", *overrides])
    runner = EmbodiedRunner(cfg)
    try:
        result = runner.train()
    finally:
        runner.close()
    return {**result, "command_s": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="maniskill_pushcube_ppo_mlp")
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["full-eval", "curtailed"])
    p.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    rows = {mode: train(args.config, mode, args.overrides) for mode in args.modes}
    print(f"\n{args.config} {' '.join(args.overrides)}, {os.cpu_count()} CPUs")
    print(f"{'mode':<12}{'iterations':>11}{'env steps':>11}{'eval success':>14}{'wall s':>9}"
          f"{'of it eval':>12}{'train s/iteration':>19}{'command s':>11}")
    for name, r in rows.items():
        print(f"{name:<12}{r['iterations']:>11}{r['env_steps']:>11}"
              f"{r.get('eval/success', float('nan')):>14.3f}{r['wall_s']:>9.0f}"
              f"{r['eval_s']:>12.0f}{_train_per_it(r):>19.2f}{r['command_s']:>11.0f}")
    first = rows[args.modes[0]]
    for name in args.modes[1:]:
        r = rows[name]
        print(f"{name} vs {args.modes[0]}: wall_ratio={r['wall_s'] / first['wall_s']:.2f} "
              f"eval_ratio={r['eval_s'] / max(first['eval_s'], 1e-9):.2f} "
              f"train_per_iteration_ratio={_train_per_it(r) / _train_per_it(first):.2f} "
              f"success={r.get('eval/success', float('nan')):.3f}")


def _train_per_it(r: dict) -> float:
    """Seconds per iteration without evaluation."""
    return (r["wall_s"] - r["eval_s"]) / max(1, r["iterations"])


if __name__ == "__main__":
    main()
