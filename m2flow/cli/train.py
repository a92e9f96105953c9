"""``m2flow-train``: a Hydra-composed config, checked, trained; errors as one line.

    m2flow-train                                   # the default job (PushCube, PPO, MLP)
    m2flow-train --config-name maniskill_pickcube_ppo_mlp env.num_envs=4
    m2flow-train --cfg                             # print the composed config and exit
    m2flow-train resume=latest                     # continue this config's newest checkpoint
    m2flow-train resume=runs/X/<time> runner.num_iterations=400  # that run, its own command
    m2flow-train -m seed=0,1,2                     # a sweep: one run per job, then a summary
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Optional

from m2flow.cli.common import (
    DEFAULT_CONFIG, EXIT_CONFIG, interruptible, load_run_config, print_config, quiet_ctrl_c,
    resumed_launch, setup_logging, train_command)
from m2flow.cli.workloads import workload
from m2flow.runs.control import RunControl, launch


@quiet_ctrl_c("m2flow-train")
def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="m2flow-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", "-cn", default=None,
                        help=f"entry config in m2flow/configs (default: {DEFAULT_CONFIG}; with "
                             "resume=<run> alone, the config and overrides that run started with)")
    parser.add_argument("--cfg", action="store_true", help="print the composed config and exit")
    parser.add_argument("--multirun", "-m", action="store_true",
                        help="run every job of the sweeps in the overrides (seed=0,1,2 "
                             "algorithm.learning_rate=1e-4,3e-4), then print a summary table")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. env.num_envs=4 cluster=inprocess")
    args = parser.parse_args(argv)
    from m2flow.configs import ConfigError
    from m2flow.configs.loader import sweeps

    if args.config_name is None:
        found = None if args.multirun else resumed_launch(args.overrides)
        args.config_name, args.overrides = found or (DEFAULT_CONFIG, args.overrides)
        if found:  # (on stderr under --cfg, whose stdout is the config alone)
            print(f"resume: the run's own command: {train_command(*found)}", flush=True,
                  file=sys.stderr if args.cfg else sys.stdout)
    if args.multirun:
        from m2flow.cli.sweep import multirun

        return multirun(args.config_name, args.overrides, show_cfg=args.cfg)
    try:
        swept = sweeps(args.overrides)
        if swept:
            raise ConfigError(
                f"config error: {swept[0]} gives several values (a sweep); run every job with "
                f"-m (m2flow-train -m {shlex.join(args.overrides)}), or give one value.")
        cfg = load_run_config(args.config_name, args.overrides, make_plan=not args.cfg)
    except ConfigError as e:
        print(f"m2flow-train: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.cfg:
        return print_config(cfg)
    setup_logging()
    w = workload(cfg.workload)
    control = RunControl(launch(args.config_name, args.overrides))  # kept in its checkpoints
    return interruptible("m2flow-train", lambda: w.train(cfg, control), control=control,
                         command=lambda ckpt: train_command(args.config_name, args.overrides, ckpt),
                         hint=lambda: w.memory_hint(cfg) if w.memory_hint else "", cfg=cfg)


if __name__ == "__main__":
    sys.exit(main())
