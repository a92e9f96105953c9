"""What does a scene rebuild cost a ManiSkill CPU env from state, with and without a render
material kept alive (``m2flow.envs.maniskill._keep_a_render_material``)?

Evaluation rebuilds the scene at every reset (and training does with ``runner.exact_resets``),
so this is the part of an evaluation round that training iterations do not pay. Each case runs
in a fresh process (the material is a per-process state): ``--envs`` PushCube-v1 envs in one
process with ``render_backend='none'``, each reset ``--rounds`` times with ``reconfigure``, with
no material kept (ManiSkill as it is) and with one kept (what m2flow's env processes do). Then
the default job's env (16 envs, one process per core) through m2flow: a plain reset and a
rebuilding reset. Prints ms per env and per reset, and the ratio.

    python bench/rebuild.py [--envs 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import time
from dataclasses import replace

KW = dict(obs_mode="state", control_mode="pd_joint_delta_pos", reward_mode="normalized_dense",
          render_backend="none")


def raw_rebuild(keep: bool, envs: int, rounds: int, out) -> None:
    """In a fresh process: seconds per env of a rebuilding reset, raw ManiSkill."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401
    import torch

    from m2flow.envs.maniskill import _keep_a_render_material

    torch.set_num_threads(1)
    gc.freeze()  # as m2flow's env server does: ManiSkill's gc.collect() per rebuild skips imports
    if keep:
        _keep_a_render_material()
    made = [gym.make("PushCube-v1", num_envs=1, sim_backend="physx_cpu", **KW)
            for _ in range(envs)]
    for e in made:
        e.reset(seed=0)  # warm-up
    t0 = time.perf_counter()
    for r in range(rounds):
        for i, e in enumerate(made):
            e.reset(seed=1000 * r + i, options={"reconfigure": True})
    out.put((time.perf_counter() - t0) / (rounds * envs))


def m2flow_resets(rounds: int) -> dict:
    """The default job's env: seconds per reset of all its envs, plain and rebuilding."""
    from m2flow.cli.common import load_run_config
    from m2flow.envs import make_env

    cfg = load_run_config("maniskill_pushcube_ppo_mlp", [])
    env = make_env(replace(cfg.env))
    n = cfg.env.num_envs
    env.reset(seed=list(range(n)))
    times = {}
    for rebuild in (False, True):
        t0 = time.perf_counter()
        for r in range(rounds):
            env.reset(seed=list(range(1000 * r, 1000 * r + n)), rebuild=rebuild)
        times[rebuild] = (time.perf_counter() - t0) / rounds
    env.close()
    return {"num_envs": n, **times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    per_env = {}
    for keep in (False, True):
        q = ctx.Queue()
        proc = ctx.Process(target=raw_rebuild, args=(keep, args.envs, args.rounds, q))
        proc.start()
        per_env[keep] = q.get()
        proc.join()
    print(f"raw PushCube-v1, render_backend=none, {args.envs} envs in one process: rebuild "
          f"{per_env[False] * 1e3:.1f} ms per env without a kept material, "
          f"{per_env[True] * 1e3:.1f} with one ({per_env[False] / per_env[True]:.2f}x)")
    m = m2flow_resets(args.rounds)
    print(f"m2flow's default env ({m['num_envs']} envs): reset {m[False] * 1e3:.0f} ms, "
          f"rebuilding reset {m[True] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
