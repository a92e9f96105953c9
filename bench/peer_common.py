"""What ``bench/sac_peer.py`` and ``bench/ppo_peer.py`` share: an m2flow run and a cleanRL run
of the same ManiSkill3 task on the CPU backend, one after the other, each judged on its
training episodes (the behaviour policy, sampled actions), and the table as bench/README.md
rows.

A run's episodes are dicts in the order they finished: ``steps`` (env steps of all envs so
far), ``seconds`` (since the command's launch, start-up included) and ``success_once``.
m2flow's come from its TensorBoard scalars (``env/episodes`` and ``env/success_once`` per
iteration), cleanRL's from ``bench/cleanrl_maniskill.py``'s log, one line per episode. The
figure is the first episode after which the last ``--window`` succeeded at ``--target`` or
more (:func:`first_reach`).

cleanRL pins gymnasium 0.29.1, so it runs in a peer environment (``--peer-venv``, made on
first use: a venv that sees m2flow's site-packages behind its own gymnasium).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
PEER_GYMNASIUM = "gymnasium==0.29.1"  # cleanRL's pin


def first_reach(episodes: list[dict], target: float, window: int) -> dict | None:
    """The first episode (in order of finishing) after which the last ``window`` episodes'
    success_once rate is ``target`` or more; None if never.

    >>> eps = [{"steps": i, "success_once": i >= 3} for i in range(6)]
    >>> first_reach(eps, 0.5, 4)["steps"], first_reach(eps, 1.0, 4)
    (4, None)
    """
    hits = []
    for ep in episodes:
        hits.append(bool(ep["success_once"]))
        last = hits[-window:]
        if len(last) == window and sum(last) >= target * window - 1e-9:
            return ep
    return None


def row(run: dict, *, target: float, window: int, steps: int, date: str, commit: str,
        machine: str) -> str:
    """One bench/README.md row (date, commit, machine, command, figure) for a finished run.

    >>> eps = [{"steps": 50 * i, "seconds": 2.0 * i, "success_once": i > 1} for i in range(1, 5)]
    >>> run = {"name": "m", "command": "c", "episodes": eps, "wall": 9.4}
    >>> print(row(run, target=0.9, window=2, steps=200, date="d", commit="abc", machine="vm"))
    ... # doctest: +NORMALIZE_WHITESPACE
    | d | `abc` | vm | `c` | m: 0.9 at 150 env steps, 6 s; last 2 episodes 1.00;
    200 env steps in 9 s |
    """
    hit = first_reach(run["episodes"], target, window)
    last = run["episodes"][-window:]
    final = sum(e["success_once"] for e in last) / max(1, len(last))
    reached = (f"{target} at {hit['steps']:,} env steps, {hit['seconds']:.0f} s" if hit
               else f"{target} not reached")
    return (f"| {date} | `{commit}` | {machine} | `{run['command']}` | {run['name']}: {reached}; "
            f"last {len(last)} episodes {final:.2f}; {steps:,} env steps in {run['wall']:.0f} s |")


def peer_python(venv: Path) -> Path:
    """The peer environment's interpreter: a venv over this one's site-packages, with
    cleanRL's gymnasium first on its path."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        ours = next(p for p in sys.path if p.endswith("site-packages"))
        Path(site, "m2flow_site.pth").write_text(ours + "\n")
        subprocess.run([str(python), "-m", "pip", "install", "-q", PEER_GYMNASIUM, "tyro"],
                       check=True)
    return python


def add_arguments(p: argparse.ArgumentParser, *, config: str, steps: int) -> None:
    """The flags both benches take (``config`` and ``steps``: their defaults)."""
    p.add_argument("--cleanrl", type=Path, required=True, help="a checkout of cleanRL")
    p.add_argument("--peer-venv", type=Path, default=HERE.parent / ".peer-venv")
    p.add_argument("--config", default=config)
    p.add_argument("--steps", type=int, default=steps, help="env steps for each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--window", type=int, default=64, help="training episodes judged together")
    p.add_argument("--only", choices=["m2flow", "cleanrl"])
    p.add_argument("overrides", nargs="*", help="config overrides for the m2flow run")


def run_m2flow(args, work: Path, *, label: str) -> dict:
    """``m2flow-train --config-name args.config`` for ``args.steps`` env steps (whole
    iterations), with no evaluation before the end and no early stop; its training episodes
    from TensorBoard. ``label`` names the run in its row (``{num_envs}``: the config's)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from m2flow.cli.common import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    per_iteration = cfg.env.num_envs * cfg.runner.rollout_steps
    overrides = [f"seed={args.seed}", f"runner.num_iterations={args.steps // per_iteration}",
                 "runner.eval_interval=0", "runner.stop_at_success=null",
                 "runner.progress_bar=false", *args.overrides]
    cmd = [sys.executable, "-c", "import sys; from m2flow.cli.train import main; "
           "sys.exit(main())", "--config-name", args.config, *overrides,
           f"runner.log_dir={work / 'runs'}"]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    wall = time.time() - t0
    if proc.returncode:
        raise SystemExit(f"m2flow-train failed:\n{proc.stderr[-3000:]}")
    (tb,) = (work / "runs").glob("*/*/tb")
    ea = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    ea.Reload()
    rate = {e.step: e for e in ea.Scalars("env/success_once")}
    eps = []
    for e in ea.Scalars("env/episodes"):  # an iteration's finished episodes and their rate
        n = int(round(e.value))
        if n and e.step in rate:
            wins = int(round(rate[e.step].value * n))
            eps += [{"steps": e.step, "seconds": e.wall_time - t0, "success_once": i < wins}
                    for i in range(n)]
    return {"name": label.format(num_envs=cfg.env.num_envs), "episodes": eps, "wall": wall,
            "command": shlex.join(["m2flow-train", "--config-name", args.config, *overrides])}


def run_cleanrl(args, script: str, cli: list[str], env_cfg: dict, work: Path, *,
                label: str) -> dict:
    """cleanRL's ``script`` (e.g. ``cleanrl/ppo_continuous_action.py``), unmodified, with the
    flags ``cli`` on ``m2flow-peer/<task>`` in the peer environment; its training episodes from
    ``bench/cleanrl_maniskill.py``'s log."""
    episodes = work / "cleanrl_episodes.jsonl"
    t0 = time.time()
    env = {**os.environ, "M2FLOW_PEER_ENV": json.dumps(env_cfg), "M2FLOW_PEER_T0": str(t0)}
    proc = subprocess.run([str(peer_python(args.peer_venv)), str(HERE / "cleanrl_maniskill.py"),
                           str(args.cleanrl), script, str(episodes), "--", *cli],
                          cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"cleanRL failed:\n{proc.stderr[-3000:]}")
    eps = [json.loads(line) for line in episodes.read_text().splitlines()]
    return {"name": label, "episodes": eps, "wall": time.time() - t0,
            "command": f"{script} {shlex.join(cli)}"}


def env_config(args) -> dict:
    """The m2flow config's task, control and reward modes and episode length (None: the
    task's own), for ``bench/cleanrl_maniskill.py``."""
    from m2flow.cli.common import load_run_config

    env = load_run_config(args.config, args.overrides).env
    return {"task": env.name.split("/", 1)[1], "control_mode": env.control_mode,
            "reward_mode": env.reward_mode, "max_episode_steps": env.max_episode_steps}


def compare(args, runs: dict[str, Callable[[Path], dict]], prefix: str) -> None:
    """Runs ``runs`` ("m2flow", "cleanrl": each a function of its work folder) one after the
    other (``--only``: one of them), printing each one's row as it ends, then the table."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        for who, run in runs.items():
            if args.only not in (None, who):
                continue
            work = Path(d, who)
            work.mkdir()
            rows.append(row(run(work), target=args.target, window=args.window,
                            steps=args.steps, date=str(datetime.date.today()), commit=commit,
                            machine=f"{os.cpu_count()}-vCPU CPU VM"))
            print(rows[-1], flush=True)
    print("\n".join(rows))
