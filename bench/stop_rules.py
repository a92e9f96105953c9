"""What a stop rule costs and what it hands over, replayed over one training run per seed.

Training does not wait on evaluation's outcome: a run's weights at iteration k are those of a
run with no evaluation at all, up to the PhysX state a scene rebuild resets (evaluation
rebuilds; ``runner.exact_resets`` would make that exact). So one run per seed that saves every
``runner.checkpoint_interval`` iterations and never evaluates, and each checkpoint scored once
on the fixed initial states, answer for any rule of the ``runner.eval_*`` /
``runner.stop_*`` family on the same trajectories: the iteration it stops at, the rounds of 16
episodes it evaluates (curtailed as the runner curtails), and the score of the checkpoint it
hands over on all the fixed states. Rules are compared on the same training, which separate
runs per rule cannot do (their trajectories part after the first evaluation).

    # 1. one run per seed: no evaluation, no stop, every checkpoint kept
    m2flow-train seed=0 runner.eval_interval=0 runner.stop_at_success=null \\
        runner.keep_checkpoints=0 run_name=replay_s0
    # 2. every checkpoint on the 256 fixed states (m2flow-eval's), per episode
    python bench/stop_rules.py score runs/replay_s0/<time> runs/replay_s0.json
    # 3. the rules, with the seconds per iteration, per round and of start-up measured here
    python bench/stop_rules.py simulate runs/replay_s0/<time>=runs/replay_s0.json ... \\
        --iteration-s 1.13 --round-s 1.22 --start-s 20

A rule's seconds are modelled (start-up + iterations x iteration-s + rounds x round-s); the
figure a README quotes comes from real runs (``bench/to_target.py``).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import time
from pathlib import Path

TARGET = 0.9


def score(run_dir: str, out_path: str, episodes: int, config: str) -> None:
    """Scores each ``iter_*.pt`` of ``run_dir`` on ``episodes`` fixed initial states (the
    training-time evaluation's seeds, as ``m2flow-eval ... seed=0``); appends to
    ``out_path`` as it goes (a second call resumes)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from m2flow.cli.common import load_run_config
    from m2flow.embodied.runner import WORKLOAD, EmbodiedRunner
    from m2flow.runs import checkpoint

    out = json.loads(Path(out_path).read_text()) if Path(out_path).exists() else {}
    runner = EmbodiedRunner(load_run_config(config, ["runner.progress_bar=false",
                                                     "run_name=bench_stop_rules_score"]))
    try:
        for ck in sorted(glob.glob(f"{run_dir}/checkpoints/iter_*.pt")):
            name = Path(ck).name
            if name in out:
                continue
            runner.load_policy(checkpoint.load(ck, workload=WORKLOAD))
            t0 = time.perf_counter()
            runner.run_eval(episodes=episodes)
            res = runner.last_evaluation.results
            eps = [res[k] for k in sorted(res, key=lambda k: k[1])]
            out[name] = {"once": [int(e.success_once) for e in eps],
                         "end": [int(e.success_at_end) for e in eps],
                         "seconds": time.perf_counter() - t0}
            print(f"{name}: {sum(out[name]['once']) / len(eps):.3f} "
                  f"({out[name]['seconds']:.1f} s)", flush=True)
            Path(out_path).write_text(json.dumps(out))
    finally:
        runner.close()


def training_success(run_dir: str, metric: str = "success_once") -> list[tuple[float, float]]:
    """Per iteration (in order): (episodes that ended, their success rate) from TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir) / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    n = {e.step: e.value for e in acc.Scalars("env/episodes")}
    s = {e.step: e.value for e in acc.Scalars(f"env/{metric}")}
    return [(n[k], s.get(k, 0.0)) for k in sorted(n)]


def evaluation(once: list[int], episodes: int, known: int = 0, curtail: bool = True):
    """An evaluation of the first ``episodes`` fixed states in rounds of 16, curtailed once
    ``TARGET`` is out of reach (``eval_protocol.can_reach``, as the runner curtails); the rounds wholly within
    ``known`` are not run again. -> (rounds run, success rate of the episodes counted, reached)."""
    from m2flow.embodied.eval_protocol import can_reach

    rounds, wins = 0, 0
    for r in range(math.ceil(episodes / 16)):
        chunk = once[r * 16:min(episodes, (r + 1) * 16)]
        rounds += (r + 1) * 16 > known
        wins += sum(chunk)
        done = r * 16 + len(chunk)
        if curtail and not can_reach([bool(x) for x in once[:done]], episodes - done, TARGET):
            return rounds, wins / done, False
    return rounds, wins / episodes, wins / episodes >= TARGET


def simulate(table: dict, train: list, *, screen: int, confirm: int, gate, interval: int,
             last: int) -> dict:
    """The runner's rule (``EmbodiedRunner.evaluate``, ``evaluation_wanted``) over one run."""
    rounds, since = 0, (0.0, 0.0)
    for it in range(1, last + 1):
        n, s = train[it - 1]
        since = (since[0] + n, since[1] + n * s)
        if it % interval and it != last:
            continue
        window, since = (since[1] / since[0] if since[0] else None), (0.0, 0.0)
        if it != last and gate is not None and (window is None or window < gate):
            continue
        once = table[f"iter_{it:05d}.pt"]["once"]
        r, _, ok = evaluation(once, screen)
        rounds += r
        if ok and confirm > screen:
            r, _, ok = evaluation(once, confirm, known=screen)
            rounds += r
        if ok or it == last:
            return {"iteration": it, "reached": ok, "rounds": rounds,
                    "handed_over": sum(once) / len(once)}
    raise ValueError("no checkpoint at the last iteration")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("score", help="score every checkpoint of a run on the fixed states")
    s.add_argument("run_dir")
    s.add_argument("out")
    s.add_argument("--episodes", type=int, default=256)
    s.add_argument("--config", default="maniskill_pushcube_ppo_mlp")
    m = sub.add_parser("simulate", help="replay the rules over scored runs")
    m.add_argument("runs", nargs="+", metavar="RUN_DIR=TABLE.json")
    m.add_argument("--iteration-s", type=float, required=True)
    m.add_argument("--round-s", type=float, required=True)
    m.add_argument("--start-s", type=float, required=True)
    m.add_argument("--interval", type=int, default=10)
    m.add_argument("--last", type=int, default=150)
    m.add_argument("--screens", type=int, nargs="+", default=[16, 32, 64])
    m.add_argument("--confirms", type=int, nargs="+", default=[128, 256])
    m.add_argument("--gates", type=float, nargs="+", default=[-1, 0.5, 0.6],
                   help="-1: no gate")
    a = p.parse_args()
    if a.cmd == "score":
        score(a.run_dir, a.out, a.episodes, a.config)
        return
    runs = [(training_success(d), json.loads(Path(t).read_text()))
            for d, t in (r.split("=", 1) for r in a.runs)]
    print("| screen | confirm | gate | per run: iteration (reached), evaluation s, command s, "
          "eval share, handed over on the fixed states | median command s |")
    print("|---|---|---|---|---|")
    for screen in a.screens:
        for confirm in a.confirms:
            for gate in a.gates:
                gate = None if gate < 0 else gate
                cells, walls = [], []
                for train, table in runs:
                    r = simulate(table, train, screen=screen, confirm=confirm, gate=gate,
                                 interval=a.interval, last=a.last)
                    ev = r["rounds"] * a.round_s
                    wall = a.start_s + r["iteration"] * a.iteration_s + ev
                    walls.append(wall)
                    cells.append(f"{r['iteration']}{'' if r['reached'] else ' (not reached)'}, "
                                 f"{ev:.0f}, {wall:.0f}, {ev / wall:.0%}, "
                                 f"{r['handed_over']:.3f}")
                print(f"| {screen} | {confirm} | {gate if gate is not None else '-'} | "
                      f"{' / '.join(cells)} | {sorted(walls)[len(walls) // 2]:.0f} |")


if __name__ == "__main__":
    main()
