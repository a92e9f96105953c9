"""How fast does m2flow collect experience, against the simulator alone and a plain loop?

One run, same env and policy, measured side by side:
  sim alone      BatchedEnv.step with random actions (the ceiling)
  plain loop     cleanRL-style: policy.act + env.step in one process
  m2flow local   EmbodiedRunner.collect, components as threads in this process
  m2flow ray     EmbodiedRunner.collect, components as Ray actors (the default job)

    python bench/env_throughput.py [--env ManiSkill/PushCube-v1] [--num-envs 8] [--steps 200]
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import subprocess
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from m2flow.configs import load_train_config
from m2flow.embodied.runner import EmbodiedRunner
from m2flow.envs import make_env
from m2flow.policies import make_policy

WARMUP_STEPS = 20


def sim_alone(cfg, steps: int) -> float:
    env = make_env(cfg.env)
    try:
        env.reset(seed=list(range(env.num_envs)))
        act = lambda: torch.rand(env.num_envs, env.spec.action_dim) * 2 - 1  # noqa: E731
        for _ in range(WARMUP_STEPS):
            env.step(act())
        t = time.perf_counter()
        for _ in range(steps):
            env.step(act())
        return steps * env.num_envs / (time.perf_counter() - t)
    finally:
        env.close()


def plain_loop(cfg, steps: int) -> float:
    env = make_env(cfg.env)
    policy = make_policy(cfg.policy, env.spec).eval()
    try:
        obs = env.reset(seed=list(range(env.num_envs)))["obs"]
        t = None
        for i in range(WARMUP_STEPS + steps):
            if i == WARMUP_STEPS:
                t = time.perf_counter()
            with torch.no_grad():
                out = policy.act(TensorDict({"obs": obs}, batch_size=[env.num_envs]))
            obs = env.step(out["action"])["obs"]
        return steps * env.num_envs / (time.perf_counter() - t)
    finally:
        env.close()


def m2flow_collect(cfg, steps: int) -> float:
    cfg.runner.rollout_steps = steps
    runner = EmbodiedRunner(cfg)
    try:
        runner.collect(0)  # warm-up: starts processes, fills caches
        runner.update(0)
        t = time.perf_counter()
        runner.collect(1)
        sps = steps * runner.num_envs / (time.perf_counter() - t)
        runner.update(1)
        return sps
    finally:
        runner.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="maniskill_pushcube_ppo_mlp")
    p.add_argument("--num-envs", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    base = [f"env.num_envs={args.num_envs}", "runner.progress_bar=false"]
    cfg = lambda *o: load_train_config(args.config, [*base, *o])  # noqa: E731
    rows = [
        ("sim alone", sim_alone(cfg(), args.steps)),
        ("plain loop", plain_loop(cfg(), args.steps)),
        ("m2flow local", m2flow_collect(cfg("cluster=inprocess"), args.steps)),
        ("m2flow ray", m2flow_collect(cfg("cluster=local"), args.steps)),
    ]
    plain = rows[1][1]
    c = cfg()
    print(f"\n{c.env.name}, {args.num_envs} envs, policy {c.policy.name}, {args.steps} steps, "
          f"{os.cpu_count()} CPUs")
    print(f"{'mode':<14}{'env steps/s':>12}{'vs plain loop':>15}")
    for name, sps in rows:
        print(f"{name:<14}{sps:>12.0f}{sps / plain:>15.2f}")
    _append_csv(c, args, rows)


def _append_csv(cfg, args, rows) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    path = Path(__file__).with_name("results.csv")
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["bench", "env", "num_envs", "mode", "env_steps_per_s", "device", "commit"])
        for name, sps in rows:
            w.writerow(["env_throughput", cfg.env.name, args.num_envs, name, f"{sps:.1f}", device, commit])


if __name__ == "__main__":
    main()
