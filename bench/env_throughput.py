"""How fast does m2flow collect experience, against the simulator alone and a plain loop?

Four modes, same env and policy, alive at once and timed in interleaved rounds (this machine's
speed drifts from minute to minute, so modes timed minutes apart are not comparable):
  sim alone      BatchedEnv.step with random actions (the ceiling)
  plain loop     cleanRL-style: policy.act + env.step in one process
  m2flow local   EmbodiedRunner.collect, components as threads in this process
  m2flow ray     EmbodiedRunner.collect, components as Ray actors (the default job)

    python bench/env_throughput.py [--config maniskill_pushcube_ppo_mlp] [--num-envs 8]
                                   [--steps 100] [--rounds 5]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import record
import torch
from tensordict import TensorDict

from m2flow.cli.common import load_run_config
from m2flow.embodied.runner import EmbodiedRunner
from m2flow.envs import make_env
from m2flow.policies import make_policy

WARMUP_STEPS = 20


class SimAlone:
    def __init__(self, cfg):
        self.env = make_env(cfg.env)
        self.env.reset(seed=list(range(self.env.num_envs)))

    def run(self, k: int) -> None:
        for _ in range(k):
            self.env.step(torch.rand(self.env.num_envs, self.env.spec.action_dim) * 2 - 1)

    def close(self) -> None:
        self.env.close()


class PlainLoop(SimAlone):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.policy = make_policy(cfg.policy, self.env.spec).eval()
        self.obs = self.env.reset(seed=list(range(self.env.num_envs)))["obs"]

    def run(self, k: int) -> None:
        for _ in range(k):
            with torch.no_grad():
                out = self.policy.act(TensorDict({"obs": self.obs}, batch_size=[self.env.num_envs]))
            self.obs = self.env.step(out["action"])["obs"]


class M2flowCollect:
    def __init__(self, cfg):
        cfg.runner.reset_every_iteration = False  # time stepping, not resets
        self.runner = EmbodiedRunner(cfg)
        self.it = itertools.count()

    def run(self, k: int) -> None:
        self.runner.cfg.runner.rollout_steps = k
        self.last = next(self.it)
        self.runner.collect(self.last)

    def after(self) -> None:  # drains the trajectory channel; not timed
        self.runner.update(self.last)
        self.runner.sync_weights(self.last + 1)

    def close(self) -> None:
        self.runner.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="maniskill_pushcube_ppo_mlp")
    p.add_argument("--num-envs", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    base = [f"env.num_envs={args.num_envs}", "runner.progress_bar=false"]
    cfg = lambda *o: load_run_config(args.config, [*base, *o])  # noqa: E731
    modes = {
        "sim alone": SimAlone(cfg()),
        "plain loop": PlainLoop(cfg()),
        "m2flow local": M2flowCollect(cfg("cluster=inprocess")),
        "m2flow ray": M2flowCollect(cfg("cluster=local")),
    }
    rates: dict[str, list[float]] = {name: [] for name in modes}
    try:
        for rnd in range(args.rounds + 1):
            for name, mode in modes.items():
                steps = WARMUP_STEPS if rnd == 0 else args.steps
                t = time.perf_counter()
                mode.run(steps)
                if rnd > 0:
                    rates[name].append(steps * args.num_envs / (time.perf_counter() - t))
                getattr(mode, "after", lambda: None)()
    finally:
        for mode in modes.values():
            mode.close()
    rows = [(name, statistics.median(r), min(r), max(r)) for name, r in rates.items()]
    plain = rows[1][1]
    c = cfg()
    print(f"\n{c.env.name}, {args.num_envs} envs, policy {c.policy.name}, {args.rounds} "
          f"interleaved rounds of {args.steps} steps, {os.cpu_count()} CPUs")
    print(f"{'mode':<14}{'env steps/s':>12}{'(min-max)':>14}{'vs plain loop':>15}")
    for name, med, lo, hi in rows:
        print(f"{name:<14}{med:>12.0f}{f'({lo:.0f}-{hi:.0f})':>14}{med / plain:>15.2f}")
    record.append("env_throughput", [(c.env.name, args.num_envs, name, med) for name, med, _, _ in rows])


if __name__ == "__main__":
    main()
