"""Does learner overlap pay? The default job trained twice, without and with
``runner.overlap_learner``, in one run; wall time to reach the success target side by side.

Both runs use the same seed and config (maniskill_pushcube_ppo_mlp: PushCube-v1 from state,
PPO, 16 envs, stop at eval success >= 0.9, evaluated every 10 iterations). With overlap, the
env and rollout workers collect iteration k+1 with the previous weights while the learner
trains on iteration k (at most one update stale). The runs are sequential: training runs
take ~10 minutes each here, too long to interleave; run the script twice to see the drift.

    python bench/overlap.py [--config maniskill_pushcube_ppo_mlp] [override ...]
"""

from __future__ import annotations

import argparse
import os

from m2flow.cli import load_run_config
from m2flow.embodied.runner import EmbodiedRunner


def train(config: str, overlap: bool, overrides: list[str]) -> dict:
    cfg = load_run_config(config, [
        f"runner.overlap_learner={str(overlap).lower()}", "runner.progress_bar=false",
        f"run_name=bench_overlap_{'on' if overlap else 'off'}", *overrides,
    ])
    runner = EmbodiedRunner(cfg)
    try:
        return runner.train()
    finally:
        runner.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="maniskill_pushcube_ppo_mlp")
    p.add_argument("overrides", nargs="*", help="config overrides for both runs")
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    rows = {name: train(args.config, on, args.overrides)
            for name, on in (("sequential", False), ("overlap", True))}
    print(f"\n{args.config} {' '.join(args.overrides)}, {os.cpu_count()} CPUs")
    print(f"{'mode':<12}{'iterations':>11}{'env steps':>11}{'eval success':>14}{'wall s':>9}"
          f"{'of it eval':>12}{'train s/iteration':>19}")
    for name, r in rows.items():
        print(f"{name:<12}{r['iterations']:>11}{r['env_steps']:>11}"
              f"{r.get('eval/success', float('nan')):>14.3f}{r['wall_s']:>9.0f}"
              f"{r['eval_s']:>12.0f}{_train_per_it(r):>19.2f}")
    seq, ovl = rows["sequential"], rows["overlap"]
    print(f"overlap: wall_ratio={ovl['wall_s'] / seq['wall_s']:.2f} "
          f"train_per_iteration_ratio={_train_per_it(ovl) / _train_per_it(seq):.2f} "
          f"success={ovl.get('eval/success', float('nan')):.3f}")


def _train_per_it(r: dict) -> float:
    """Seconds per iteration without evaluation (the same 64-episode evaluations in both)."""
    return (r["wall_s"] - r["eval_s"]) / max(1, r["iterations"])


if __name__ == "__main__":
    main()
