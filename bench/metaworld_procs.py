"""Meta-World env steps per second: every env in this process, or one process per env.

Cases: ``state`` (physics only), ``rgb`` at --sizes px with ``render_quality`` fast (no MSAA,
no shadow maps) and, with --standard, Meta-World's standard look. Each case builds the
MT10 suite with --envs envs (env i on task i) both ways (``env.processes`` false / true),
alive at once and timed in interleaved rounds (this machine's speed drifts under other
load); random actions, episodes auto-reset as they end. Prints env steps/s per case and way
(the median of the rounds) with the CPU time per env step of this process and its env
processes (which other load on the machine changes less), and appends them to
bench/results.csv.

    python bench/metaworld_procs.py [--envs 4] [--steps 50] [--rounds 3] [--sizes 64 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import psutil
import record
import torch

from m2flow.envs import env_config, make_env

WARMUP_STEPS = 5
WAYS = {"in-process": False, "processes": True}


def cpu_seconds(env) -> float:
    """CPU time (user + system) spent so far by this process and ``env``'s env processes."""
    procs = [psutil.Process()] + [psutil.Process(p) for p in getattr(env.slots, "pids", [])]
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def rate(env, steps: int, gen: torch.Generator) -> tuple[float, float]:
    """(env steps per second, CPU milliseconds per env step) of ``steps`` batched steps with
    random actions. The CPU cost does not depend on how many cores other jobs leave free."""
    n = env.num_envs
    start, cpu = time.perf_counter(), cpu_seconds(env)
    for _ in range(steps):
        env.step(torch.rand(n, 4, generator=gen) * 2 - 1)
    return n * steps / (time.perf_counter() - start), 1e3 * (cpu_seconds(env) - cpu) / (n * steps)


def cases(sizes, standard: bool) -> dict:
    out = {"state": ("state", 64, "fast")}
    for s in sizes:
        out[f"rgb{s} fast"] = ("rgb", s, "fast")
        if standard:
            out[f"rgb{s} standard"] = ("rgb", s, "standard")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", type=int, default=4)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    p.add_argument("--standard", action="store_true")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for case, (mode, size, quality) in cases(args.sizes, args.standard).items():
        envs = {}
        try:
            for way, procs in WAYS.items():
                envs[way] = make_env(env_config(
                    name="MetaWorld/MT10", num_envs=args.envs, obs_mode=mode, image_size=size,
                    render_quality=quality, processes=procs,
                    task_ids=[i % 10 for i in range(args.envs)]))
                envs[way].reset(seed=list(range(args.envs)), task=list(range(args.envs)))
                rate(envs[way], WARMUP_STEPS, gen)
            got = {way: [] for way in WAYS}
            for _ in range(args.rounds):
                for way, env in envs.items():
                    got[way].append(rate(env, args.steps, gen))
        finally:
            for env in envs.values():
                env.close()
        for way, got_way in got.items():
            rates, cpu = [r for r, _ in got_way], statistics.median(c for _, c in got_way)
            median = statistics.median(rates)
            print(f"{case:18s} {way:10s} {args.envs} envs: {median:7.1f} env steps/s "
                  f"(rounds: {', '.join(f'{r:.0f}' for r in rates)}), {cpu:.2f} CPU ms per "
                  "env step", flush=True)
            rows.append((f"MT10 {case}", args.envs, way, median))
    record.append("metaworld_procs", rows)


if __name__ == "__main__":
    main()
