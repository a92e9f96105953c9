"""Does m2flow train mjlab's Cartpole as well and as fast as mjlab's own trainer (rsl-rl)?
Both trainers, one after the other, on the same envs and env steps; one table.

- ``m2flow``: ``m2flow-train --config-name mjlab_cartpole_ppo_mlp`` (mjlab's PPO
  hyper-parameters, see the config's header), with ``env.num_envs``, ``runner.num_iterations``
  and ``seed`` from the arguments; evaluations in the run are off but the last (m2flow always
  evaluates at the end: one round, ``num_envs`` episodes), whose time is left out of ``wall s``.
- ``mjlab``: ``python -m mjlab.scripts.train <task>`` (rsl-rl 5.4 ``OnPolicyRunner``, the task's
  own rl cfg: 32 steps per env and iteration), tensorboard logger (no W&B), on the CPU
  (``CUDA_VISIBLE_DEVICES=""``).

Each runs iterations x 32 x num_envs env steps as a subprocess; ``wall s`` is its wall clock
(start-up included; Warp's kernels are compiled by a warm-up before either), and the line
below the table gives each trainer's own loop time (m2flow: ``perf/iteration_s``; rsl-rl:
``Perf/collection_time`` + ``Perf/learning_time``; summed over iterations).

``final training return`` is the mean return of the last 100 training episodes: rsl-rl's
``Train/mean_reward`` at its last iteration (its rolling mean of 100 episodes); for m2flow, the
episode-weighted mean of ``env/return`` (the episodes that ended in an iteration) over the
last iterations that hold 100 episodes. Both start each env's first episode at a random
step (rsl-rl's ``init_at_random_ep_len``, m2flow's ``runner.stagger_episodes``), so the first
episodes are partial and later ones end at every iteration. ``eval return`` scores both
final policies alike: one m2flow env of 32 envs, reset with seeds 10000..10031, one full
episode each with mean actions (the env clips
them as both trainers' envs do: the rl cfg's ``clip_actions``). Curves (env steps -> training
return) go to ``<out>/curves.csv`` and ``<out>/curves.png``, the rows to ``<out>/summary.json``.

    python bench/mjlab_cartpole.py                                    # balance, 64 envs, 500 it
    python bench/mjlab_cartpole.py --task Mjlab-Cartpole-Swingup --seed 1
    python bench/mjlab_cartpole.py --only mjlab --out /tmp/cartpole_s0    # one trainer
    # smoke test (minutes): 50-step episodes, 4 evaluation episodes
    python bench/mjlab_cartpole.py --num-envs 8 --iterations 3 --episode-steps 50 --eval-episodes 4
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ENV_GROUPS = {"Mjlab-Cartpole-Balance": "mjlab_cartpole_balance",
              "Mjlab-Cartpole-Swingup": "mjlab_cartpole_swingup"}
STEPS_PER_ENV = 32  # the rl cfg's num_steps_per_env (and the m2flow config's rollout_steps)
FINAL_EPISODES = 100  # rsl-rl's Train/mean_reward averages its last 100 episodes
EVAL_SEED = 10_000
VENV_BIN = Path(sys.executable).parent
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "RAY_USAGE_STATS_ENABLED": "0",
       "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


def run(name: str, cmd: list[str], out: Path, env: dict | None = None) -> float:
    """Runs ``cmd`` (its output to ``<out>/<name>.log``, with ``env``, default: on the CPU); its
    wall seconds. Exits on failure."""
    return run_bounded(name, cmd, out, env or ENV, None)[0]


def run_bounded(name: str, cmd: list[str], out: Path, env: dict,
                timeout: float | None) -> tuple[float, bool]:
    """``run`` that, past ``timeout`` seconds, gives ``cmd`` Ctrl-C (then, 30 s on, a kill): its
    wall seconds and whether it was cut. Exits on another failure."""
    print(f"{name}: {shlex.join(cmd)}", flush=True)
    log = out / f"{name}.log"
    t0 = time.perf_counter()
    with log.open("w") as f:
        # its own process group only when it may be cut (else a Ctrl-C here reaches it too)
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=timeout is not None)
        try:
            rc, cut = proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc, cut = 0, True
    if rc != 0:
        sys.exit(f"{name} failed (exit {rc}); the end of {log}:\n"
                 + "".join(log.read_text().splitlines(True)[-20:]))
    return time.perf_counter() - t0, cut


def newest(pattern: str, root: Path) -> Path:
    found = sorted(root.glob(pattern))
    if not found:
        sys.exit(f"no {pattern} under {root}")
    return found[-1]  # timestamped names sort in time order


def train_m2flow(args, out: Path) -> dict:
    log_dir = out / "m2flow"
    cmd = [str(VENV_BIN / "m2flow-train"), "--config-name", "mjlab_cartpole_ppo_mlp",
           f"env={ENV_GROUPS[args.task]}", f"env.num_envs={args.num_envs}",
           f"runner.num_iterations={args.iterations}", f"seed={args.seed}",
           f"runner.log_dir={log_dir}", "runner.progress_bar=false", "runner.eval_interval=0",
           f"runner.eval_episodes={args.num_envs}", "runner.checkpoint_interval=50",
           *([f"env.max_episode_steps={args.episode_steps}"] if args.episode_steps else []),
           *args.overrides]
    wall = run("m2flow", cmd, out)
    from m2flow.runs.plot import Curve, read_run

    run_dir = newest("*/*/tb", log_dir).parent
    curves = read_run(run_dir)
    ret = curves.get("env/return", Curve([], [], []))  # absent: no episode ended
    eps = dict(zip(curves["env/episodes"].steps, curves["env/episodes"].values))
    points = [(s, v, eps[s]) for s, v in zip(ret.steps, ret.values)]
    tail, n = [], 0.0
    for s, v, e in reversed(points):  # the last iterations holding FINAL_EPISODES episodes
        if n >= FINAL_EPISODES:
            break
        tail.append((v, e))
        n += e
    final = sum(v * e for v, e in tail) / n if n else math.nan
    eval_s = sum(curves["time/eval"].values) if "time/eval" in curves else 0.0
    steps = max(max(c.steps) for c in curves.values())
    loop_s = sum(curves["perf/iteration_s"].values)
    return {"trainer": "m2flow", "env_steps": steps, "wall_s": wall - eval_s, "loop_s": loop_s,
            "final_return": final, "curve": [(s, v) for s, v, _ in points],
            "checkpoint": str(run_dir / "checkpoints" / "last.pt"), "run_dir": str(run_dir)}


def train_mjlab(args, out: Path) -> dict:
    log_root = out / "mjlab"
    cmd = [sys.executable, "-m", "mjlab.scripts.train", args.task,
           "--env.scene.num-envs", str(args.num_envs),
           "--agent.max-iterations", str(args.iterations), "--agent.seed", str(args.seed),
           "--agent.logger", "tensorboard", "--agent.upload-model", "False",
           "--log-root", str(log_root)]
    if args.episode_steps:  # as m2flow's adapter sets it: mjlab runs ceil(length / dt) steps
        cmd += ["--env.episode-length-s", str((args.episode_steps - 0.5) * step_dt(args.task))]
    wall = run("mjlab", cmd, out)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = newest("*/*/params", log_root).parent
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    per_it = STEPS_PER_ENV * args.num_envs
    has_episodes = "Train/mean_reward" in acc.Tags()["scalars"]  # absent: no episode ended
    rewards = acc.Scalars("Train/mean_reward") if has_episodes else []
    last_it = max(e.step for e in acc.Scalars("Perf/total_fps"))
    ckpt = max(run_dir.glob("model_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    loop_s = sum(e.value for tag in ("Perf/collection_time", "Perf/learning_time")
                 for e in acc.Scalars(tag))
    return {"trainer": "mjlab (rsl-rl)", "env_steps": (last_it + 1) * per_it, "wall_s": wall,
            "loop_s": loop_s,
            "final_return": rewards[-1].value if rewards else math.nan,
            "curve": [((e.step + 1) * per_it, e.value) for e in rewards],
            "checkpoint": str(ckpt), "run_dir": str(run_dir)}


def step_dt(task: str) -> float:
    from mjlab.tasks.registry import load_env_cfg

    cfg = load_env_cfg(task)
    return cfg.sim.mujoco.timestep * cfg.decimation


def m2flow_actor(ckpt: str, env):
    """The run's policy (``m2flow-eval``'s loading), acting with its mean action."""
    from m2flow.cli.common import load_eval_config
    from m2flow.policies import make_policy

    cfg, state = load_eval_config([f"checkpoint={ckpt}"])
    policy = make_policy(cfg.policy, env.spec).eval()
    policy.load_state_dict(state["learner"]["policy"])
    return lambda batch: policy.act(batch, deterministic=True)["action"]


def rsl_rl_actor(ckpt: str, env):
    """The actor rsl-rl's ``PPO.construct_algorithm`` builds from the run's params/agent.yaml
    (after ``MjlabOnPolicyRunner`` drops the None options), its deterministic output."""
    import torch
    import yaml
    from rsl_rl.utils import resolve_callable, resolve_obs_groups
    from tensordict import TensorDict

    cfg = yaml.load((Path(ckpt).parent / "params" / "agent.yaml").read_text(), yaml.FullLoader)
    actor_cfg = {k: v for k, v in cfg["actor"].items()
                 if not (k in ("cnn_cfg", "distribution_cfg") and v is None)}
    if actor_cfg.get("rnn_type") is None:
        for k in ("rnn_type", "rnn_hidden_dim", "rnn_num_layers"):
            actor_cfg.pop(k, None)
    groups = list(cfg["obs_groups"]["actor"])
    if groups != ["actor"]:  # m2flow's ("obs", "state") is mjlab's actor group alone
        sys.exit(f"rsl-rl's actor reads {groups}; this bench feeds it mjlab's 'actor' group")
    obs = TensorDict({"actor": torch.zeros(1, env.spec.obs_shapes["state"][0])}, batch_size=[1])
    obs_groups = resolve_obs_groups(obs, {"actor": groups}, ["actor"])
    cls = resolve_callable(actor_cfg.pop("class_name"))
    actor = cls(obs, obs_groups, "actor", env.spec.action_dim, **actor_cfg).eval()
    actor.load_state_dict(torch.load(ckpt, map_location="cpu")["actor_state_dict"])
    return lambda batch: actor(TensorDict({"actor": batch["obs", "state"]},
                                          batch_size=batch.batch_size))


def evaluate(env, act) -> float:
    """Mean return of one episode per env from seeds EVAL_SEED.., mean actions."""
    import torch

    batch = env.reset(seed=list(range(EVAL_SEED, EVAL_SEED + env.num_envs)))
    ret = torch.zeros(env.num_envs)
    live = torch.ones(env.num_envs, dtype=torch.bool)
    with torch.inference_mode():
        for _ in range(env.spec.max_episode_steps):
            batch = env.step(act(batch))
            ret += batch["next", "reward"] * live
            live &= ~batch["next", "done"]
            if not live.any():
                break
    return ret.mean().item()


def eval_env(args):
    import warp

    from m2flow.envs import env_config, make_env

    warp.config.log_level = warp.LOG_WARNING  # no line per kernel module (Warp 1.19: not quiet)
    return make_env(env_config(name=f"mjlab/{args.task}", num_envs=args.eval_episodes,
                               max_episode_steps=args.episode_steps))


def write_curves(rows: list[dict], out: Path) -> None:
    with (out / "curves.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["trainer", "env_steps", "return"])
        for r in rows:
            w.writerows([r["trainer"], s, v] for s, v in r["curve"])
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in rows:
        steps, values = zip(*r["curve"]) if r["curve"] else ((), ())
        ax.plot(steps, values, marker=".", label=r["trainer"])
    ax.set(xlabel="env steps", ylabel="training episode return")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=sorted(ENV_GROUPS), default="Mjlab-Cartpole-Balance")
    p.add_argument("--num-envs", type=int, default=64)
    p.add_argument("--iterations", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("/tmp/bench_mjlab_cartpole"))
    p.add_argument("--only", choices=["m2flow", "mjlab", "both"], default="both")
    p.add_argument("--episode-steps", type=int, default=None,
                   help="episode length for training and evaluation (default: the task's, 1000)")
    p.add_argument("--eval-episodes", type=int, default=32)
    p.add_argument("overrides", nargs="*", help="extra overrides for m2flow-train")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print("warm-up (Warp kernels): one env built and stepped", flush=True)
    run("warmup", [sys.executable, "-c", "import torch; from m2flow.envs import env_config, "
                   f"make_env; e = make_env(env_config(name='mjlab/{args.task}', num_envs=1)); "
                   "e.reset(seed=[0]); e.step(torch.zeros(1, e.spec.action_dim)); e.close()"],
        args.out)
    trainers = {"m2flow": (train_m2flow, m2flow_actor), "mjlab": (train_mjlab, rsl_rl_actor)}
    chosen = list(trainers) if args.only == "both" else [args.only]
    rows = [trainers[t][0](args, args.out) for t in chosen]  # one after the other
    env = eval_env(args)
    for t, r in zip(chosen, rows):
        r["eval_return"] = evaluate(env, trainers[t][1](r["checkpoint"], env))
    env.close()
    write_curves(rows, args.out)
    print(f"\n{args.task}, {args.num_envs} envs, {args.iterations} iterations, seed {args.seed}; "
          f"curves in {args.out}/curves.csv, curves.png")
    print(f"| trainer | env steps | wall s | env steps/s | final training return "
          f"| eval return ({args.eval_episodes} episodes) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['trainer']} | {r['env_steps']:,} | {r['wall_s']:.0f} "
              f"| {r['env_steps'] / r['wall_s']:.0f} | {r['final_return']:.2f} "
              f"| {r['eval_return']:.2f} |")
    print("training loop alone (no start-up, no evaluation): "
          + ", ".join(f"{r['trainer']} {r['loop_s']:.0f} s ({r['env_steps'] / r['loop_s']:.0f} "
                      "env steps/s)" for r in rows))


if __name__ == "__main__":
    main()
