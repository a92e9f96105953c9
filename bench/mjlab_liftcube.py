"""Lift-Cube-Yam from state on one GPU: m2flow against mjlab's own trainer (rsl-rl), side by side.
Env steps per second, and the success rate each reaches after the same wall time.

- ``m2flow``: ``m2flow-train --config-name mjlab_liftcube_ppo_mlp`` (mjlab's PPO settings for
  the task, privileged critic; ``cluster=mjlab_gpu_inprocess``: simulation, rollout and learner
  on GPU 0 in one process), with ``env.num_envs``, ``runner.num_iterations`` and ``seed`` from
  the arguments. Its closing evaluation (m2flow always evaluates at the end) is left out of
  its times.
- ``mjlab``: ``python -m mjlab.scripts.train Mjlab-Lift-Cube-Yam`` (rsl-rl's ``OnPolicyRunner``
  with the task's rl cfg), the same envs and iterations (24 steps per env and iteration in
  both), tensorboard logger, on GPU 0.

One after the other, each a subprocess, after a warm-up that compiles Warp's kernels for the GPU
(cached in Warp's kernel cache, so neither trainer pays for them). Per iteration, both log the
success rate of the training episodes that ended in it: the lift command's goal reached at some
step of the episode (m2flow ``env/success_once``; mjlab ``Metrics/lift_height/episode_success``,
its mean over the envs reset in each step). ``success @ T`` is each trainer's last logged value
at or before T seconds of training (time since its first iteration was logged), T the shorter
of the two runs; ``env steps/s`` is env steps over that loop time.

    python bench/mjlab_liftcube.py                                  # 4096 envs, 150 iterations
    python bench/mjlab_liftcube.py --num-envs 8 --iterations 3      # smoke test (CPU: --cpu)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from mjlab_cartpole import newest, run

TASK = "Mjlab-Lift-Cube-Yam"
STEPS_PER_ENV = 24  # the task's rl cfg num_steps_per_env, and the m2flow config's rollout_steps
VENV_BIN = Path(sys.executable).parent
M2FLOW_SUCCESS = "env/success_once"
MJLAB_SUCCESS = "Metrics/lift_height/episode_success"


def train_m2flow(args, out: Path, env: dict) -> dict:
    log_dir = out / "m2flow"
    cmd = [sys.executable, "-c", "from m2flow.cli.train import main; raise SystemExit(main())",
           "--config-name", "mjlab_liftcube_ppo_mlp", f"env.num_envs={args.num_envs}",
           f"runner.num_iterations={args.iterations}", f"seed={args.seed}",
           f"runner.log_dir={log_dir}", "runner.progress_bar=false", "runner.eval_interval=0",
           f"runner.eval_episodes={args.num_envs}", "runner.checkpoint_interval=0",
           *(["cluster=inprocess"] if args.cpu else []), *args.overrides]
    wall = run("m2flow", cmd, out, env)
    from m2flow.runs.plot import read_run

    curves = read_run(newest("*/*/tb", log_dir).parent)
    loop = curves["perf/iteration_s"]
    succ = curves.get(M2FLOW_SUCCESS)
    eval_s = sum(curves["time/eval"].values) if "time/eval" in curves else 0.0
    return {"trainer": "m2flow", "wall_s": wall - eval_s, "loop_s": sum(loop.values),
            "env_steps": max(loop.steps),
            # seconds since the first iteration's scalars, as for rsl-rl's events below
            "curve": list(zip(succ.seconds, succ.steps, succ.values)) if succ else []}


def train_mjlab(args, out: Path, env: dict) -> dict:
    log_root = out / "mjlab"
    cmd = [sys.executable, "-m", "mjlab.scripts.train", TASK,
           "--env.scene.num-envs", str(args.num_envs),
           "--agent.max-iterations", str(args.iterations), "--agent.seed", str(args.seed),
           "--agent.logger", "tensorboard", "--agent.upload-model", "False",
           "--agent.save-interval", str(10 * args.iterations), "--log-root", str(log_root)]
    wall = run("mjlab", cmd, out, env)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(newest("*/*/params", log_root).parent), size_guidance={"scalars": 0})
    acc.Reload()
    per_it = STEPS_PER_ENV * args.num_envs
    fps = acc.Scalars("Perf/total_fps")
    t0 = fps[0].wall_time
    succ = acc.Scalars(MJLAB_SUCCESS) if MJLAB_SUCCESS in acc.Tags()["scalars"] else []
    loop_s = sum(e.value for tag in ("Perf/collection_time", "Perf/learning_time")
                 for e in acc.Scalars(tag))
    return {"trainer": "mjlab (rsl-rl)", "wall_s": wall, "loop_s": loop_s,
            "env_steps": (max(e.step for e in fps) + 1) * per_it,
            "curve": [(e.wall_time - t0, (e.step + 1) * per_it, e.value) for e in succ]}


def at(curve: list, t: float) -> float:
    """The last value logged at or before ``t`` seconds (nan: none yet)."""
    vals = [v for s, _, v in curve if s <= t]
    return vals[-1] if vals else math.nan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-envs", type=int, default=4096)
    p.add_argument("--iterations", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("/tmp/bench_mjlab_liftcube"))
    p.add_argument("--only", choices=["m2flow", "mjlab", "both"], default="both")
    p.add_argument("--cpu", action="store_true", help="rehearse on Warp's CPU device")
    p.add_argument("--results", type=Path, help="append the rows here (JSON lines)")
    p.add_argument("overrides", nargs="*", help="extra overrides for m2flow-train")
    args = p.parse_args()
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
    trainers = {"m2flow": train_m2flow, "mjlab": train_mjlab}
    chosen = list(trainers) if args.only == "both" else [args.only]
    rows = [trainers[c](args, args.out, env) for c in chosen]
    horizon = min(r["curve"][-1][0] if r["curve"] else 0.0 for r in rows)
    for r in rows:
        r["success_at_T"] = at(r["curve"], horizon)
        r["final_success"] = r["curve"][-1][2] if r["curve"] else math.nan
        r["env_steps_per_s"] = r["env_steps"] / r["loop_s"]
    (args.out / "summary.json").write_text(json.dumps(
        {"task": TASK, "device": device, "num_envs": args.num_envs,
         "iterations": args.iterations, "seed": args.seed, "warmup_s": warmup_s,
         "T_s": horizon, "rows": rows}, indent=1))
    if args.results:
        with args.results.open("a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "mjlab_liftcube", "device": device,
                                    "num_envs": args.num_envs, "iterations": args.iterations,
                                    **{k: v for k, v in r.items() if k != "curve"}}) + "\n")
    print(f"\n{TASK} on {device}, {args.num_envs} envs, {args.iterations} iterations, seed "
          f"{args.seed}; warm-up (Warp compile) {warmup_s:.0f} s; T = {horizon:.0f} s")
    print("| trainer | env steps | loop s | env steps/s | success @ T | final success | wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['trainer']} | {r['env_steps']:,} | {r['loop_s']:.0f} "
              f"| {r['env_steps_per_s']:,.0f} | {r['success_at_T']:.3f} "
              f"| {r['final_success']:.3f} | {r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
