"""``m2flow-demos``: successful demonstrations from ManiSkill's motion-planning solutions, with
the observations m2flow's env gives a policy, in ManiSkill's own trajectory format.

    m2flow-demos                             # demos/PickCube-v1_rgb64.h5: rgb 64 px, 100 episodes
    m2flow-demos env=maniskill_pushcube_rgb  # demos/PushCube-v1_rgb64.h5
    m2flow-demos env=maniskill_pickcube env.obs_mode=state demos.episodes=20 demos.output=demos/x
    m2flow-demos --cfg                       # print the composed config and exit

How they are made and stored (the rest of ``--help``): :mod:`m2flow.embodied.demos.maniskill`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from m2flow.cli.common import EXIT_CONFIG, print_config, signals_as_ctrl_c
from m2flow.embodied.demos import maniskill as library
from m2flow.embodied.demos.maniskill import (
    CONFIG_DIR, DEFAULT_CONFIG, generate, load_demos_config, output_stem, save)

HELP = f"{__doc__}\n{library.__doc__.split(chr(10), 3)[3]}"  # this, then the library's account


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="m2flow-demos", description=HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", "-cn", default=DEFAULT_CONFIG,
                        help=f"config in m2flow/configs/{CONFIG_DIR} (default: {DEFAULT_CONFIG})")
    parser.add_argument("--cfg", action="store_true", help="print the composed config and exit")
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides, e.g. env=maniskill_pushcube_rgb demos.episodes=10")
    args = parser.parse_args(argv)
    from m2flow.configs import ConfigError

    try:
        cfg = load_demos_config(args.config_name, args.overrides)
    except ConfigError as e:
        print(f"m2flow-demos: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.cfg:
        return print_config(cfg)
    stem = output_stem(cfg)
    print(f"m2flow-demos: {cfg.env.name} ({cfg.env.obs_mode}, {cfg.env.control_mode}) -> "
          f"{stem}.h5", flush=True)
    restore, code = signals_as_ctrl_c()
    try:
        demos, tally, spec = generate(cfg, log=lambda line: print(line, flush=True))
    except KeyboardInterrupt:  # while the simulator started: no seed tried yet
        print("m2flow-demos: interrupted during start-up; nothing was written.",
              file=sys.stderr, flush=True)
        return code()
    finally:
        restore()
    if tally.interrupted:  # Ctrl-C or SIGTERM: what was kept is written, and said so
        wrote = "nothing was written"
        if demos:
            wrote = f"wrote {save(stem, demos, cfg.env, spec)[0]} with them"
        print(f"m2flow-demos: interrupted after {tally.tried} episodes tried, {tally.kept} of "
              f"{cfg.demos.episodes} kept; {wrote}.", file=sys.stderr, flush=True)
        return code()
    h5_path, _ = save(stem, demos, cfg.env, spec)
    steps = sum(len(d.actions) for d in demos)
    print(f"m2flow-demos: {tally.tried} episodes tried, motion planner solved {tally.planned}, "
          f"{tally.converted} succeed after conversion, kept {tally.kept} ({steps} steps) in "
          f"{tally.seconds:.0f} s; wrote {h5_path} and its .json", flush=True)
    return 0 if tally.kept >= cfg.demos.episodes else 1


if __name__ == "__main__":
    sys.exit(main())
