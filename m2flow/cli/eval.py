"""``m2flow-eval``: N episodes per task of any registered env, with a checkpoint or a policy
config's initial weights; writes results.json, results.md and MP4 videos.

    m2flow-eval checkpoint=runs/.../checkpoints/last.pt episodes=64
    m2flow-eval checkpoint=runs/maniskill_pickcube_ppo_mlp     # its newest run's newest checkpoint
    m2flow-eval env=libero_spatial policy=cnn episodes_per_task=2 videos_per_task=1
    m2flow-eval config=libero_spatial_ppo_cnn episodes_per_task=50
    m2flow-eval checkpoint=runs/libero_object_bc_mlp episodes_per_task=10 first_episode=10
    m2flow-eval checkpoint=runs/reasoning_arith_grpo_tiny/.../checkpoints/last.pt size=200
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from m2flow.cli.common import (
    EXIT_CONFIG, interruptible, load_eval_config, quiet_ctrl_c, setup_logging)
from m2flow.cli.workloads import workload
from m2flow.runs.control import RunControl


@quiet_ctrl_c("m2flow-eval")
def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="m2flow-eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*",
                        help="checkpoint=PATH or config groups (env=..., policy=...), "
                             "episodes_per_task=N, first_episode=F, videos_per_task=K, and "
                             "dotted overrides")
    args = parser.parse_args(argv)
    from m2flow.configs import ConfigError

    try:
        cfg, state = load_eval_config(args.overrides)
    except ConfigError as e:
        print(f"m2flow-eval: {e}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging()
    w = workload(cfg.workload)
    env = getattr(cfg, "env", None)  # no learner here: only the simulators' count to lower
    control = RunControl()
    return interruptible("m2flow-eval", lambda: w.evaluate(cfg, state, control), control=control,
                         hint=lambda: f"lower env.num_envs (now {env.num_envs})" if env else "",
                         cfg=cfg)


if __name__ == "__main__":
    sys.exit(main())
