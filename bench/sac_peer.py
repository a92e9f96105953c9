"""SAC in m2flow beside cleanRL's SAC on the same ManiSkill3 task through the CPU backend, for
the same env steps: env steps and wall time until the training episodes reach a success rate.

ManiSkill's own SAC baseline (``examples/baselines/sac/sac.py``) makes its envs with
``sim_backend="gpu"`` and cannot run here, so the peer is cleanRL's
``cleanrl/sac_continuous_action.py``, unmodified, from a checkout (``--cleanrl``; measured at
commit fe8d8a0), over ManiSkill's CPU gym env (``bench/cleanrl_maniskill.py``): one env, one
update of 256 transitions per env step, twin 256x2 critics, gamma 0.99, its other defaults.
It runs in a peer environment with the gymnasium cleanRL pins (0.29.1), made on first use
(``--peer-venv``: a venv that sees m2flow's site-packages behind its own gymnasium).

m2flow runs ``m2flow-train --config-name CONFIG`` (16 envs, overlapped learner), with no
evaluation before the end and no early stop, so both spend their time on the same thing.
Both are judged on their training episodes (the behaviour policy, sampled actions): the first
env step at which the last ``--window`` finished episodes succeeded (``success_once``) at
``--target`` or more, and the wall time from the command's launch to then (start-up
included). The runs are sequential; the table comes out as bench/README.md rows.

    python bench/sac_peer.py --cleanrl /path/to/cleanrl --steps 50000
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


def run_cleanrl(args, env_cfg: dict, work: Path) -> dict:
    episodes = work / "cleanrl_episodes.jsonl"
    cli = ["--env-id", f"m2flow-peer/{env_cfg['task']}", "--total-timesteps", str(args.steps),
           "--seed", str(args.seed), "--no-cuda"]
    t0 = time.time()
    env = {**os.environ, "M2FLOW_PEER_ENV": json.dumps(env_cfg), "M2FLOW_PEER_T0": str(t0)}
    proc = subprocess.run([str(peer_python(args.peer_venv)), str(HERE / "cleanrl_maniskill.py"),
                           str(args.cleanrl), str(episodes), "--", *cli],
                          cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"cleanRL failed:\n{proc.stderr[-3000:]}")
    eps = [json.loads(l) for l in episodes.read_text().splitlines()]
    return {"name": "cleanRL sac_continuous_action.py (1 env)", "episodes": eps,
            "wall": time.time() - t0,
            "command": "cleanrl/sac_continuous_action.py " + shlex.join(cli)}


def run_m2flow(args, work: Path) -> dict:
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
    return {"name": f"m2flow SAC ({cfg.env.num_envs} envs, overlapped learner)",
            "episodes": eps, "wall": wall,
            "command": shlex.join(["m2flow-train", "--config-name", args.config, *overrides])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cleanrl", type=Path, required=True, help="a checkout of cleanRL")
    p.add_argument("--peer-venv", type=Path, default=HERE.parent / ".peer-venv")
    p.add_argument("--config", default="maniskill_pushcube_sac_mlp")
    p.add_argument("--steps", type=int, default=50_000, help="env steps for each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--window", type=int, default=64, help="training episodes judged together")
    p.add_argument("--only", choices=["m2flow", "cleanrl"])
    p.add_argument("overrides", nargs="*", help="config overrides for the m2flow run")
    args = p.parse_args()

    from m2flow.cli.common import load_run_config

    env = load_run_config(args.config, args.overrides).env
    env_cfg = {"task": env.name.split("/", 1)[1], "control_mode": env.control_mode,
               "reward_mode": env.reward_mode}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sac_peer_") as d:
        for who in ("m2flow", "cleanrl"):
            if args.only not in (None, who):
                continue
            work = Path(d, who)
            work.mkdir()
            r = run_m2flow(args, work) if who == "m2flow" else run_cleanrl(args, env_cfg, work)
            hit = first_reach(r["episodes"], args.target, args.window)
            last = r["episodes"][-args.window:]
            final = sum(e["success_once"] for e in last) / max(1, len(last))
            reached = (f"{args.target} at {hit['steps']:,} env steps, {hit['seconds']:.0f} s"
                       if hit else f"{args.target} not reached")
            rows.append(f"| {datetime.date.today()} | `{commit}` | {os.cpu_count()}-vCPU CPU VM "
                        f"| `{r['command']}` | {r['name']}: {reached}; last {len(last)} "
                        f"episodes {final:.2f}; {args.steps:,} env steps in {r['wall']:.0f} s |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
