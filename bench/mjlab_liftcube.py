"""Lift-Cube-Yam from state on one GPU: m2flow against mjlab's own trainer (rsl-rl), side by side,
on the same number of env steps: env steps per second, and the success rate each reaches.

- ``m2flow``: ``m2flow-train --config-name mjlab_liftcube_ppo_mlp`` (mjlab's PPO settings for
  the task, privileged critic; ``cluster=mjlab_gpu_inprocess``: simulation, rollout and learner
  on GPU 0 in one process), with ``env.num_envs`` and ``seed`` from the arguments, for
  ``--budget-s`` seconds of its loop (``runner.max_minutes``) or ``--iterations``. Its closing
  evaluation (m2flow always evaluates at the end: one round of ``num_envs`` 1000-step episodes,
  a batch per call) is left out of its times.
- ``mjlab``: ``python -m mjlab.scripts.train Mjlab-Lift-Cube-Yam`` (rsl-rl's ``OnPolicyRunner``
  with the task's rl cfg), the same envs and as many iterations as m2flow ran (24 steps per env
  and iteration in both), tensorboard logger, on GPU 0. ``--mjlab-timeout-s`` bounds it: a run
  past it is interrupted and compared on the iterations it logged (rsl-rl flushes every 10 s).

One after the other, each a subprocess, after a warm-up that compiles Warp's kernels for the GPU
(cached in Warp's kernel cache, so neither trainer pays for them). Per iteration, both log the
success rate of the training episodes that ended in it: the lift command's goal reached at some
step of the episode (m2flow ``env/success_once``; mjlab ``Metrics/lift_height/episode_success``,
its mean over the envs reset in each step). ``success @ N`` is each trainer's last logged value
at or before N env steps, N the fewer of the two runs'; ``env steps/s`` is env steps over the
trainer's own loop time (m2flow ``perf/iteration_s``, rsl-rl collection + learning time).

    python bench/mjlab_liftcube.py                                  # 4096 envs, 50 s of m2flow
    python bench/mjlab_liftcube.py --iterations 150                 # a fixed count for both
    python bench/mjlab_liftcube.py --cpu --num-envs 8 --budget-s 20 # rehearsal on Warp's CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from mjlab_cartpole import newest, run, run_bounded

TASK = "Mjlab-Lift-Cube-Yam"
STEPS_PER_ENV = 24  # the task's rl cfg num_steps_per_env, and the m2flow config's rollout_steps
VENV_BIN = Path(sys.executable).parent
M2FLOW_SUCCESS = "env/success_once"
MJLAB_SUCCESS = "Metrics/lift_height/episode_success"


def train_m2flow(args, out: Path, env: dict) -> dict:
    log_dir = out / "m2flow"
    # the closing evaluation takes the batch per call: one env per call (the default, so that
    # success does not depend on the batch) would be 4096 calls per step of 1000-step episodes
    cmd = [sys.executable, "-c", "from m2flow.cli.train import main; raise SystemExit(main())",
           "--config-name", "mjlab_liftcube_ppo_mlp", f"env.num_envs={args.num_envs}",
           f"runner.num_iterations={args.iterations or 1_000_000}", f"seed={args.seed}",
           f"runner.max_minutes={args.budget_s / 60 if not args.iterations else 'null'}",
           f"runner.log_dir={log_dir}", "runner.progress_bar=false", "runner.eval_interval=0",
           f"runner.eval_episodes={args.num_envs}", "runner.eval_batch_invariant=false",
           "runner.checkpoint_interval=0", *(["cluster=inprocess"] if args.cpu else []),
           *args.overrides]
    wall = run("m2flow", cmd, out, env)
    from m2flow.runs.plot import read_run

    curves = read_run(newest("*/*/tb", log_dir).parent)
    loop = curves["perf/iteration_s"]
    succ = curves.get(M2FLOW_SUCCESS)
    eval_s = sum(curves["time/eval"].values) if "time/eval" in curves else 0.0
    return {"trainer": "m2flow", "wall_s": wall - eval_s, "loop_s": sum(loop.values),
            "iterations": len(loop.values), "env_steps": max(loop.steps), "cut": False,
            "curve": list(zip(loop.steps, succ.values)) if succ else []}


def train_mjlab(args, out: Path, env: dict, iterations: int) -> dict:
    log_root = out / "mjlab"
    cmd = [sys.executable, "-m", "mjlab.scripts.train", TASK,
           "--env.scene.num-envs", str(args.num_envs),
           "--agent.max-iterations", str(iterations), "--agent.seed", str(args.seed),
           "--agent.logger", "tensorboard", "--agent.upload-model", "False",
           "--agent.save-interval", str(10 * iterations), "--log-root", str(log_root)]
    wall, cut = run_bounded("mjlab", cmd, out, env, args.mjlab_timeout_s)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(newest("*/*/events.*", log_root).parent),
                           size_guidance={"scalars": 0})
    acc.Reload()
    per_it = STEPS_PER_ENV * args.num_envs
    fps = acc.Scalars("Perf/total_fps")
    succ = acc.Scalars(MJLAB_SUCCESS) if MJLAB_SUCCESS in acc.Tags()["scalars"] else []
    loop_s = sum(e.value for tag in ("Perf/collection_time", "Perf/learning_time")
                 for e in acc.Scalars(tag))
    return {"trainer": "mjlab (rsl-rl)", "wall_s": wall, "loop_s": loop_s,
            "iterations": len(fps), "env_steps": (max(e.step for e in fps) + 1) * per_it,
            "cut": cut, "curve": [((e.step + 1) * per_it, e.value) for e in succ]}


def at(curve: list, n: int) -> float:
    """The last value logged at or before ``n`` env steps (nan: none yet)."""
    vals = [v for s, v in curve if s <= n]
    return vals[-1] if vals else math.nan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-envs", type=int, default=4096)
    p.add_argument("--budget-s", type=float, default=50.0,
                   help="m2flow's loop time (runner.max_minutes); mjlab runs as many iterations")
    p.add_argument("--iterations", type=int, help="a fixed iteration count for both, not a budget")
    p.add_argument("--mjlab-timeout-s", type=float, help="interrupt mjlab's run after this")
    p.add_argument("--deadline-s", type=float,
                   help="the whole command's wall time: m2flow's budget and mjlab's timeout "
                        "shrink to fit it, so that a slow warm-up (Warp's first compile) still "
                        "leaves both a turn and the table printed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("/tmp/bench_mjlab_liftcube"))
    p.add_argument("--only", choices=["m2flow", "mjlab", "both"], default="both")
    p.add_argument("--cpu", action="store_true", help="rehearse on Warp's CPU device")
    p.add_argument("--results", type=Path, help="append the rows here (JSON lines)")
    p.add_argument("overrides", nargs="*", help="extra overrides for m2flow-train")
    args = p.parse_args()
    if args.only == "mjlab" and not args.iterations:
        p.error("--only mjlab needs --iterations (the budget is m2flow's)")
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "WANDB_MODE": "disabled",
           "PYTHONUNBUFFERED": "1", **({"CUDA_VISIBLE_DEVICES": ""} if args.cpu else {})}
    device = "cpu" if args.cpu else "cuda:0"
    print(f"warm-up (Warp kernels on {device}): {args.num_envs} envs built and stepped", flush=True)
    t = time.perf_counter()
    run("warmup", [sys.executable, "-c", "import torch; from m2flow.envs import env_config, make_env; "
                   f"e = make_env(env_config(name='mjlab/{TASK}', num_envs={args.num_envs}), "
                   f"device='{device}'); e.reset(seed=list(range(e.num_envs))); "
                   f"[e.step(torch.zeros(e.num_envs, e.spec.action_dim, device='{device}')) "
                   "for _ in range(3)]; e.close()"], args.out, env)
    warmup_s = time.perf_counter() - t
    print(f"warm-up: {warmup_s:.0f} s", flush=True)
    left = lambda: args.deadline_s - (time.perf_counter() - t)  # noqa: E731
    if args.deadline_s and not args.iterations and args.only == "both":
        # each trainer's start-up and m2flow's closing evaluation: ~70 s on the GPU together
        args.budget_s = min(args.budget_s, max(10.0, (left() - 70) / 2))
        print(f"m2flow's budget: {args.budget_s:.0f} s (deadline in {left():.0f} s)", flush=True)
    rows = []
    if args.only in ("m2flow", "both"):
        rows.append(train_m2flow(args, args.out, env))
        r = rows[-1]
        print(f"m2flow: {r['iterations']} iterations, {r['env_steps']:,} env steps in "
              f"{r['loop_s']:.0f} s: {r['env_steps'] / r['loop_s']:,.0f} env steps/s", flush=True)
    if args.only in ("mjlab", "both"):
        if args.deadline_s:
            cap = max(10.0, left() - 15)
            args.mjlab_timeout_s = min(args.mjlab_timeout_s or cap, cap)
        rows.append(train_mjlab(args, args.out, env, args.iterations or rows[0]["iterations"]))
    n = min(r["env_steps"] for r in rows)
    for r in rows:
        r["success_at_n"] = at(r["curve"], n)
        r["final_success"] = r["curve"][-1][1] if r["curve"] else math.nan
        r["env_steps_per_s"] = r["env_steps"] / r["loop_s"]
    (args.out / "summary.json").write_text(json.dumps(
        {"task": TASK, "device": device, "num_envs": args.num_envs, "budget_s": args.budget_s,
         "iterations": args.iterations, "seed": args.seed, "warmup_s": warmup_s, "N": n,
         "rows": rows}, indent=1))
    if args.results:
        with args.results.open("a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "mjlab_liftcube", "device": device,
                                    "num_envs": args.num_envs, "warmup_s": round(warmup_s, 1),
                                    **{k: v for k, v in r.items() if k != "curve"}}) + "\n")
    print(f"\n{TASK} on {device}, {args.num_envs} envs, seed {args.seed}; warm-up (Warp "
          f"compile) {warmup_s:.0f} s; N = {n:,} env steps")
    print("| trainer | iterations | env steps | loop s | env steps/s | success @ N "
          "| final success | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['trainer']}{' (cut)' if r['cut'] else ''} | {r['iterations']} "
              f"| {r['env_steps']:,} | {r['loop_s']:.0f} | {r['env_steps_per_s']:,.0f} "
              f"| {r['success_at_n']:.3f} | {r['final_success']:.3f} | {r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
