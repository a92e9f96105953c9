"""``m2flow-plot RUN_DIR...``: learning curves of runs into one PNG.

    m2flow-plot runs/maniskill_pushcube_ppo_mlp/*/ -o pushcube.png
    m2flow-plot runs/a runs/b --metrics eval/success_at_end env/return
    m2flow-plot runs/ppo_from_bc/*/ --baseline runs/bc/<time>/eval/<time>/results.json

Each metric gets a panel against the logged step and one against wall time; runs are overlaid,
labelled by their folder (:mod:`m2flow.runs.plot`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from m2flow.runs.plot import DEFAULT_METRICS, plot


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="m2flow-plot", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (runs/<name>/<time>)")
    parser.add_argument("-o", "--out", type=Path, default=Path("curves.png"),
                        help="the PNG to write (default curves.png)")
    parser.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS),
                        help=f"scalar tags to draw (default {' '.join(DEFAULT_METRICS)})")
    parser.add_argument("--baseline", nargs="+", type=Path, default=[],
                        help="m2flow-eval reports (results.json) drawn as dashed levels, e.g. "
                             "the checkpoint RL started from")
    args = parser.parse_args(argv)
    try:
        out = plot(args.runs, args.out, tuple(args.metrics), tuple(args.baseline))
    except ValueError as e:
        print(f"m2flow-plot: {e}", file=sys.stderr)
        return 2
    print(f"m2flow-plot: {len(args.runs)} run(s), {', '.join(args.metrics)} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
