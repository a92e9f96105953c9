"""How much memory and start-up does a simulator process cost, against ManiSkill's own layout?

Each case builds the same single-env simulators in two layouts, each in a fresh process, one
after the other in this run:
  peer    gymnasium AsyncVectorEnv of the envs, the layout of
          mani_skill/examples/benchmarking/gpu_sim.py --cpu-sim (state: forked from the
          parent; rgb: from the stdlib forkserver, as fork deadlocks under a renderer)
  m2flow  make_env: ProcessSlots, one process per env forked from m2flow's fork server
and reports PSS (proportional set size, /proc/PID/smaps_rollup) per simulator process and of
the whole process tree, seconds from launching the process to the first step, env steps/s
(random actions). Cases: state (ManiSkill PushCube-v1), rgb (PushCube-v1 rgb 128 px), libero
(LIBERO libero_spatial rgb 128 px, two cameras). ``job`` runs the default job (m2flow-train,
maniskill_pushcube_ppo_mlp, 16 envs under Ray) for a few iterations and reports its process
tree's peak PSS (driver, Ray and its workers, fork server, simulators) and how many of its
envs fit in 24 GiB.

    python bench/memory.py [--cases state,rgb,libero,job] [--num-envs 16] [--steps 100]
                           [--layouts peer,m2flow] [--job-iterations 12]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LAUNCH = time.time()  # before the heavy imports: seconds to the first step include them
MiB, GiB = 2**20, 2**30
BUDGET = 24 * GiB  # the machine the issue sizes runs for
CASES = {  # case -> (env config group, overrides)
    "state": ("maniskill_pushcube", {}),  # the default job's env
    "rgb": ("maniskill_pushcube_rgb", {"image_size": 128}),
    "libero": ("libero_spatial", {"image_size": 128}),  # two cameras
}
WARMUP = 5
ROOT = Path(__file__).resolve().parent.parent


def pss(pid: int) -> tuple[int, int]:
    """(PSS, private bytes) of one process (0, 0 if it has gone)."""
    out = {"Pss:": 0, "Private_Clean:": 0, "Private_Dirty:": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                k, v, *_ = line.split()
                if k in out:
                    out[k] = int(v) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out["Pss:"], out["Private_Clean:"] + out["Private_Dirty:"]


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


# -- one layout of one case, in this (fresh) process ------------------------------------------
def env_config(case: str, n: int):
    """The case's env config, read without m2flow.cli: the peer's parent imports only what a
    peer script would (its simulator, torch, gymnasium)."""
    import yaml

    from m2flow.envs import env_config as settings

    group, overrides = CASES[case]
    with open(ROOT / "m2flow" / "configs" / "env" / f"{group}.yaml") as f:
        fields = yaml.safe_load(f)
    fields.pop("defaults", None)  # the schema line: settings() picks the adapter's class
    return settings(**{**fields, **overrides, "num_envs": n})


def peer_env_fns(cfg) -> list:
    """The single envs m2flow's adapter builds for ``cfg``, for gymnasium's AsyncVectorEnv."""
    if cfg.name.startswith("LIBERO/"):
        import importlib

        from m2flow.envs import libero as adapter

        suite = adapter.check_config(cfg)
        adapter.prepare(cfg.assets_path)
        importlib.import_module("libero.libero.envs")  # a peer script imports its simulator
        limit = adapter.SUITE_MAX_STEPS[suite]
        ids = list(range(len(adapter.suite_tasks(suite))))
        return [functools.partial(adapter.LiberoTaskEnv, suite, ids, i % len(ids), limit, cfg)
                for i in range(cfg.num_envs)]
    import mani_skill.envs  # noqa: F401

    from m2flow.envs import maniskill

    kw = dict(obs_mode=cfg.obs_mode, render_backend="none" if cfg.obs_mode == "state" else "cpu",
              control_mode=cfg.control_mode, reward_mode=cfg.reward_mode)
    if cfg.obs_mode != "state":
        kw["sensor_configs"] = dict(width=cfg.image_size, height=cfg.image_size)
    task = cfg.name.split("/", 1)[1]
    make = functools.partial(maniskill._make_cpu_env, task, cfg.obs_mode,
                             cfg.ignore_terminations, kw)
    return [make] * cfg.num_envs


def measure(case: str, layout: str, n: int, steps: int, launched: float) -> dict:
    import numpy as np

    cfg = env_config(case, n)
    rng = np.random.default_rng(0)
    if layout == "peer":
        from gymnasium.vector import AsyncVectorEnv

        # fork (gymnasium's default, gpu_sim.py's on Linux) deadlocks a child here once a
        # renderer runs in the parent, and AsyncVectorEnv builds one env in the parent for its
        # spaces: with rendering, forkserver (what gpu_sim.py takes where fork fails)
        context = None if cfg.obs_mode == "state" else "forkserver"
        env = AsyncVectorEnv(peer_env_fns(cfg), context=context)
        env.reset(seed=list(range(n)))
        step = env.step
        sims = [p.pid for p in env.processes]
        act_dim = env.single_action_space.shape[0]
    else:
        import torch

        from m2flow.envs import make_env

        env = make_env(cfg)
        env.reset(seed=list(range(n)))
        step = lambda a: env.step(torch.as_tensor(a, dtype=torch.float32))  # noqa: E731
        slots = getattr(env, "_impl", env).slots
        sims, act_dim = slots.pids, env.spec.action_dim
    actions = lambda: rng.uniform(-1, 1, (n, act_dim)).astype(np.float32)  # noqa: E731
    step(actions())
    first = time.time() - launched
    for _ in range(WARMUP):
        step(actions())
    t = time.perf_counter()
    for _ in range(steps):
        step(actions())
    rate = steps * n / (time.perf_counter() - t)
    sim_mem = [pss(p) for p in sims]
    whole = sum(pss(p)[0] for p in tree(os.getpid()))
    env.close()
    return dict(case=case, layout=layout, n=n, first_step_s=first, steps_per_s=rate,
                pss_sim=sum(m[0] for m in sim_mem) / n, private_sim=sum(m[1] for m in sim_mem) / n,
                pss_whole=whole)


def run_child(case: str, layout: str, n: int, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", case, layout, str(n), str(steps), str(time.time())]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{case}/{layout} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


# -- the default job under Ray ------------------------------------------------------------
def measure_job(iterations: int) -> dict:
    """Runs m2flow-train (the default job) and samples its process tree's PSS every second."""
    with tempfile.TemporaryDirectory() as log_dir:
        cmd = [str(ROOT / ".venv/bin/m2flow-train"), f"runner.num_iterations={iterations}",
               f"runner.log_dir={log_dir}", "runner.progress_bar=false"]
        start = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        err = []
        threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
        peak: dict = {"whole": 0}
        while proc.poll() is None:
            groups = dict.fromkeys(
                ("driver", "ray, other", "ray workers", "fork server", "simulators"), 0)
            pids = tree(proc.pid)
            forked = {p for p in pids if "multiprocessing.forkserver" in cmdline(p)}
            servers = {p for p in forked if _ppid(p) not in forked}  # sims share their cmdline
            sims = []
            for pid in pids:
                ppid = _ppid(pid)
                group = ("driver" if pid == proc.pid else "fork server" if pid in servers
                         else "simulators" if ppid in servers
                         else "ray workers" if cmdline(pid).startswith("ray::") else "ray, other")
                mem = pss(pid)
                groups[group] += mem[0]
                if group == "simulators":
                    sims.append(mem)
            whole = sum(groups.values())
            if whole > peak["whole"]:
                peak = dict(whole=whole, groups=groups, n=len(sims), t=time.time() - start,
                            pss_sim=sum(m[0] for m in sims) / max(1, len(sims)))
            time.sleep(1.0)
        if proc.returncode:
            raise RuntimeError(f"m2flow-train failed:\n{b''.join(err).decode()[-3000:]}")
    peak["wall_s"] = time.time() - start
    return peak


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return -1


def fit(whole: float, n: int, per_sim: float) -> int:
    """Envs that fit in BUDGET: what the run needs besides its simulators, plus one PSS each."""
    return int((BUDGET - (whole - n * per_sim)) // per_sim)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="state,rgb,libero,job")
    p.add_argument("--num-envs", type=int, default=16,
                   help="state envs (the default job's); rgb: half as many, libero: a quarter")
    p.add_argument("--steps", type=int, default=100, help="timed steps (rgb, libero: a fifth)")
    p.add_argument("--job-iterations", type=int, default=12)
    p.add_argument("--layouts", default="peer,m2flow")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        case, layout, n, steps, launched = args.child
        print(json.dumps(measure(case, layout, int(n), int(steps), float(launched))), flush=True)
        return
    cases = args.cases.split(",")
    rows = []
    for case in (c for c in cases if c in CASES):
        n = {"state": args.num_envs, "rgb": args.num_envs // 2}.get(case, args.num_envs // 4)
        steps = args.steps if case == "state" else max(10, args.steps // 5)
        for layout in args.layouts.split(","):
            rows.append(run_child(case, layout, n, steps))
            print(f"  {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    print(f"\n{len(os.sched_getaffinity(0))} CPUs, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'case':<8}{'layout':<8}{'envs':>5}{'PSS/sim MB':>11}{'private/sim':>12}"
          f"{'whole MB':>10}{'1st step s':>11}{'steps/s':>9}{'fit 24GiB':>10}")
    for r in rows:
        print(f"{r['case']:<8}{r['layout']:<8}{r['n']:>5}{r['pss_sim'] / MiB:>11.0f}"
              f"{r['private_sim'] / MiB:>12.0f}{r['pss_whole'] / MiB:>10.0f}"
              f"{r['first_step_s']:>11.1f}{r['steps_per_s']:>9.0f}"
              f"{fit(r['pss_whole'], r['n'], r['pss_sim']):>10}")
    if "job" in cases:
        job = measure_job(args.job_iterations)
        print(f"  {json.dumps(job)}", file=sys.stderr, flush=True)
        print(f"\ndefault job (m2flow-train --config-name maniskill_pushcube_ppo_mlp, {args.job_iterations} "
              f"iterations, {job['wall_s']:.0f} s): peak whole-run PSS {job['whole'] / MiB:.0f} MB "
              f"at {job['t']:.0f} s, {job['n']} simulators of {job['pss_sim'] / MiB:.0f} MB each; "
              f"envs that fit in 24 GiB: {fit(job['whole'], job['n'], job['pss_sim'])}")
        print("  " + ", ".join(f"{k} {v / MiB:.0f} MB" for k, v in job["groups"].items()))


if __name__ == "__main__":
    main()
