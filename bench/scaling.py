"""How does iteration throughput scale with the number of env workers (1, 2, 3)?

One runner per worker count, all alive in one Ray and timed in interleaved rounds (this
machine's speed drifts from minute to minute): each round runs ``--iterations`` full
iterations (collect, update, weight sync) of every runner. Each env worker steps
``--num-envs`` envs, so an iteration of E workers collects E times the samples; perfect
scaling keeps the iteration time flat and multiplies env steps/s by E. Reported: s/iteration,
env steps/s, speedup over the first count and efficiency (speedup / worker ratio).

The cluster group decides where the workers run: ``--cluster local`` (default) starts a Ray on
this machine; a group with ``address: auto`` (``--cluster ray_multinode``) joins a running
cluster, where adding env workers adds machines' cores only if the env's node has them.

    python bench/scaling.py [--workers 1 2 3] [--num-envs 4] [--rollout-steps 32]
                            [--iterations 2] [--rounds 3] [--cluster local] [override ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import record

from m2flow.cli.common import load_run_config
from m2flow.embodied.runner import EmbodiedRunner
from m2flow.pipelines import Cluster

CONFIG = "maniskill_pushcube_ppo_mlp"


def runner_for(workers: int, args) -> EmbodiedRunner:
    cfg = load_run_config(args.config, [
        f"cluster={args.cluster}", f"cluster.placement.components.env.workers={workers}",
        f"env.num_envs={args.num_envs}", f"runner.rollout_steps={args.rollout_steps}",
        "runner.progress_bar=false", *args.overrides])
    return EmbodiedRunner(cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--cluster", default="local", help="cluster group (a Ray one)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--num-envs", type=int, default=4, help="envs per env worker")
    p.add_argument("--rollout-steps", type=int, default=32)
    p.add_argument("--iterations", type=int, default=2, help="timed iterations per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("overrides", nargs="*", help="more config overrides, e.g. seed=1")
    args = p.parse_args()

    first = load_run_config(args.config, [f"cluster={args.cluster}", *args.overrides])
    if first.cluster.backend != "ray":
        p.error(f"--cluster {args.cluster} is not a Ray cluster group; env workers need Ray")
    cluster = Cluster(first.cluster)  # one Ray for every runner; each runner reuses it
    runners = {w: runner_for(w, args) for w in args.workers}
    seconds: dict[int, list[float]] = {w: [] for w in args.workers}
    steps: dict[int, int] = {}
    it = 0
    try:
        for rnd in range(args.rounds + 1):  # round 0 warms up (first batches, JIT, caches)
            for w, runner in runners.items():
                t = time.perf_counter()
                before = runner.global_step
                for k in range(args.iterations):
                    runner.iterate(it + k)
                if rnd > 0:
                    seconds[w].append((time.perf_counter() - t) / args.iterations)
                steps[w] = (runner.global_step - before) // args.iterations
            it += args.iterations
    finally:
        for runner in reversed(list(runners.values())):
            runner.close()
        cluster.shutdown()

    base = args.workers[0]
    s_base = statistics.median(seconds[base])
    rate_base = steps[base] / s_base
    print(f"\n{first.env.name}, {args.num_envs} envs per env worker, {args.rollout_steps} steps, "
          f"policy {first.policy.name}, cluster={args.cluster} ({len(cluster.nodes)} node(s), "
          f"{sum(n.num_cpus for n in cluster.nodes)} CPUs; this machine {os.cpu_count()}), "
          f"{args.rounds} interleaved rounds of {args.iterations} iterations")
    print(f"{'env workers':>11}{'s/iter':>9}{'(min-max)':>15}{'env steps/s':>13}"
          f"{'speedup':>9}{'efficiency':>12}")
    rows = []
    for w in args.workers:
        med = statistics.median(seconds[w])
        rate = steps[w] / med
        speedup = rate / rate_base
        span = f"({min(seconds[w]):.2f}-{max(seconds[w]):.2f})"
        print(f"{w:>11}{med:>9.2f}{span:>15}{rate:>13.0f}{speedup:>9.2f}"
              f"{speedup / (w / base):>12.2f}")
        rows.append((first.env.name, args.num_envs * w, f"{w} env workers", rate))
    print(f"scaling: {' '.join(f'{w}w={steps[w] / statistics.median(seconds[w]):.0f}' for w in args.workers)} env steps/s")
    record.append("scaling", rows)


if __name__ == "__main__":
    main()
