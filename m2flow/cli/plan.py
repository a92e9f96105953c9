"""``m2flow-plan``: measure a config's components, search every plan, keep the best as a file.

    m2flow-plan --config-name maniskill_pushcube_ppo_cnn        # profile, plan, write the file
    m2flow-plan --config-name maniskill_pushcube_ppo_cnn --verify   # + run the best two for real
    m2flow-plan --config-name X --profile plans/X.profile.json  # plan again, no measuring
    m2flow-train --config-name X cluster.plan=plans/X.yaml      # train with the plan
    m2flow-train --config-name X cluster.plan=auto              # plan at start-up, watch drift

It prints the best plans (predicted seconds per iteration, throughput, memory; infeasible ones
with the reason), writes the chosen one to ``plans/<config>.yaml`` (``-o``) and the measured
profile next to it (``.profile.json``). The planner is :mod:`m2flow.pipelines.planner`; each
workload measures its own components (``m2flow.cli.workloads.PLANNERS``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from m2flow.cli.common import (
    DEFAULT_CONFIG, EXIT_CONFIG, load_run_config, setup_logging, signals_as_ctrl_c)
from m2flow.cli.planning import PLAN_DIR, make_plan, verify, without_plan
from m2flow.pipelines.planner.search import PlanError


def main(argv: Optional[list[str]] = None) -> int:
    """``m2flow-plan``; Ctrl-C or SIGTERM ends it with one line (what it measured is closed
    first), exit code 130 or 143."""
    restore, code = signals_as_ctrl_c()
    try:
        return run(argv)
    except KeyboardInterrupt:
        print("\nm2flow-plan: interrupted; no plan written.", file=sys.stderr, flush=True)
        return code()
    finally:
        restore()


def run(argv: Optional[list[str]] = None) -> int:
    from m2flow.configs import ConfigError

    parser = argparse.ArgumentParser(prog="m2flow-plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", "-cn", default=DEFAULT_CONFIG,
                        help=f"entry config in m2flow/configs (default: {DEFAULT_CONFIG})")
    parser.add_argument("--output", "-o", default=None,
                        help=f"plan file to write (default: {PLAN_DIR}/<config name>.yaml)")
    parser.add_argument("--profile", default=None,
                        help="a profile written by an earlier m2flow-plan: plan without measuring")
    parser.add_argument("--top", type=int, default=10, help="feasible plans to print")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="skip the short real run of the config as it is that measures "
                             "the framework's own cost per iteration")
    parser.add_argument("--no-overlap", action="store_true",
                        help="leave learner overlap out of the plans (it trains on data one "
                             "update stale, which can cost more iterations than it saves)")
    parser.add_argument("--verify", action="store_true",
                        help="run the chosen plan and the runner-up for real and print "
                             "predicted against measured iteration time")
    parser.add_argument("--iterations", type=int, default=3,
                        help="timed iterations per plan with --verify (after one warm-up)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as m2flow-train takes")
    args = parser.parse_args(argv)
    overrides = without_plan(args.overrides)
    output = Path(args.output or Path(PLAN_DIR) / f"{args.config_name}.yaml")
    try:
        if args.profile and not Path(args.profile).is_file():
            raise ConfigError(f"config error: --profile {args.profile}: no such file; give a "
                              ".profile.json written by m2flow-plan.")
        cfg = load_run_config(args.config_name, overrides)
        if cfg.cluster.address is not None:
            raise ConfigError(
                f"config error: cluster.address={cfg.cluster.address}: m2flow-plan plans the "
                "machine it runs on; run it on one node of the cluster without cluster.address.")
        setup_logging()
        preds, graph = make_plan(cfg, args.config_name, overrides, output=output,
                                 profile_path=args.profile, top=args.top,
                                 calibrate=not args.no_calibrate,
                                 overlap=not args.no_overlap)
    except (ConfigError, PlanError) as e:
        text = str(e)
        print(f"m2flow-plan: {text if text.startswith('config error') else 'error: ' + text}",
              file=sys.stderr)
        return EXIT_CONFIG
    print(f"plan: written to {output}; train with: m2flow-train --config-name "
          f"{args.config_name} cluster.plan={output}", flush=True)
    if args.verify:
        verify(args.config_name, overrides, preds, graph, iterations=args.iterations)
    return 0


if __name__ == "__main__":
    sys.exit(main())
