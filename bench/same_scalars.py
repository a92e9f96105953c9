"""Do two versions of the code compute the same run? The logged scalars of a run's first N
iterations, recorded from one checkout and compared exactly with another's.

A refactor that claims "no behaviour change" shows it here: run ``record`` from a worktree of
the commit before and of the commit after, then ``compare``. The job keeps its full config
(``runner.num_iterations`` untouched, so schedules such as ``anneal_lr`` are those of the real
run): the script stops it with Ctrl-C (SIGINT) once iteration N-1's line is logged and keeps
the scalars of iterations 0 to N-1. Wall-clock tags (``time/``, ``perf/``, ``switch/``) are
left out; every other value must be equal to the bit.

    # PYTHONPATH picks the checkout whose m2flow runs (a worktree of the commit before); the
    # job runs with that checkout as its current directory, since Ray puts the driver's
    # current directory before PYTHONPATH on every worker's path
    git worktree add /tmp/before <commit>
    PYTHONPATH=/tmp/before python bench/same_scalars.py record --iterations 30 --out /tmp/a.json
    PYTHONPATH=$PWD python bench/same_scalars.py record --iterations 30 --out /tmp/b.json
    python bench/same_scalars.py compare /tmp/a.json /tmp/b.json
    # the reasoning job: record --iterations 5 --out X.json -- --config-name reasoning_arith_grpo_tiny
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

UNTIMED = ("time/", "perf/", "switch/")


def checkout() -> Path:
    """The checkout whose ``m2flow`` the job imports: the first PYTHONPATH entry holding an
    ``m2flow`` package, else this script's repository. The job runs there: Ray inserts the
    driver's current directory into each worker's ``sys.path`` ahead of PYTHONPATH, so a job
    started elsewhere would run the env, rollout and learner workers from that directory's
    m2flow, whatever PYTHONPATH says."""
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and (Path(entry) / "m2flow" / "__init__.py").is_file():
            return Path(entry).resolve()
    return Path(__file__).resolve().parent.parent


def record(iterations: int, overrides: list[str], out: Path) -> int:
    """Runs ``m2flow-train`` with ``overrides``, stops it after iteration ``iterations``-1
    and writes {tag: {step: value}} of iterations 0..N-1 to ``out``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = Path(tempfile.mkdtemp(prefix="same_scalars_"))
    entry = ("import sys\ntry:\n    from m2flow.cli.train import main as train\n"
             "except ImportError:  # before m2flow.cli became a package\n"
             "    from m2flow.cli import train\nsys.exit(train(sys.argv[1:]))")
    # -P: no current directory first on sys.path, so PYTHONPATH picks the checkout that runs
    cmd = [sys.executable, "-P", "-c", entry, *overrides,
           f"runner.log_dir={log_dir}", "runner.progress_bar=false",
           "runner.checkpoint_interval=0"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    where = checkout()
    print(f"same_scalars: running m2flow from {where}", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=where)
    last_step, done = None, re.compile(rf"^.*\bit\s+{iterations - 1}\s+\|\s+steps\s+(\d+)")
    for line in proc.stdout:
        sys.stdout.write(line)
        m = done.match(line)
        if m and last_step is None:
            last_step = int(m.group(1))
            proc.send_signal(signal.SIGINT)
    proc.wait()
    if last_step is None:
        print(f"same_scalars: the run ended (exit {proc.returncode}) before iteration "
              f"{iterations - 1}", file=sys.stderr)
        return 1
    run_dir = next(p for p in log_dir.glob("*/*") if (p / "tb").is_dir())
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: {str(e.step): e.value for e in acc.Scalars(tag) if e.step <= last_step}
               for tag in sorted(acc.Tags()["scalars"]) if not tag.startswith(UNTIMED)}
    out.write_text(json.dumps({"overrides": overrides, "iterations": iterations,
                               "scalars": scalars}, indent=1, sort_keys=True) + "\n")
    n = sum(len(v) for v in scalars.values())
    print(f"same_scalars: {n} values of {len(scalars)} tags up to step {last_step} -> {out}")
    return 0


def compare(a: Path, b: Path, any_overrides: bool = False) -> int:
    """Exact comparison of two records; prints each difference, exit 1 if any.
    ``any_overrides``: compare records whose overrides differ (a later commit's run held back
    to an earlier default by overrides), printing both."""
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    if ra["iterations"] != rb["iterations"] or (
            ra["overrides"] != rb["overrides"] and not any_overrides):
        print("same_scalars: the records come from different commands (--any-overrides "
              "compares runs whose overrides differ)", file=sys.stderr)
        return 2
    if ra["overrides"] != rb["overrides"]:
        print(f"same_scalars: overrides {ra['overrides']} against {rb['overrides']}")
    sa, sb = ra["scalars"], rb["scalars"]
    diff = [f"{t}: only in {a.name if t in sa else b.name}" for t in sorted(sa.keys() ^ sb.keys())]
    for tag in sorted(sa.keys() & sb.keys()):
        for step in sorted(sa[tag].keys() | sb[tag].keys(), key=int):
            if sa[tag].get(step) != sb[tag].get(step):
                diff.append(f"{tag} at step {step}: {sa[tag].get(step)} vs {sb[tag].get(step)}")
    n = sum(len(v) for v in sa.values())
    for line in diff:
        print(line)
    print(f"same_scalars: {len(diff)} differences among {n} values of {len(sa)} tags "
          f"({ra['iterations']} iterations)")
    return 1 if diff else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--iterations", type=int, default=30)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("overrides", nargs="*", help="after --: m2flow-train arguments")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--any-overrides", action="store_true",
                   help="compare records whose m2flow-train overrides differ")
    args = p.parse_args()
    if args.cmd == "record":
        return record(args.iterations, args.overrides, args.out)
    return compare(args.a, args.b, args.any_overrides)


if __name__ == "__main__":
    sys.exit(main())
