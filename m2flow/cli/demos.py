"""``m2flow-demos``: successful demonstrations from a scripted expert, with the observations
m2flow's env gives a policy, in ManiSkill's own trajectory format. The env family picks the
expert (:data:`m2flow.embodied.demos.RECORDERS`): ManiSkill's motion-planning solutions
(:mod:`m2flow.embodied.demos.maniskill`), LIBERO's scripted expert
(:mod:`m2flow.embodied.demos.libero`); each family has its own entry config in
``m2flow/configs/demos/``.

    m2flow-demos                             # demos/PickCube-v1_rgb64.h5: rgb 64 px, 100 episodes
    m2flow-demos env=maniskill_pushcube_rgb  # demos/PushCube-v1_rgb64.h5
    m2flow-demos env=maniskill_pickcube env.obs_mode=state demos.episodes=20 demos.output=demos/x
    m2flow-demos env=libero_object           # demos/libero_object_rgb128.h5: 50 init states x 10 tasks
    m2flow-demos --cfg                       # print the composed config and exit
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from m2flow.cli.common import EXIT_CONFIG, print_config, signals_as_ctrl_c
from m2flow.embodied import demos as recorders


def env_family(config_name: Optional[str], overrides: Sequence[str]) -> str:
    """The env family the command records: that of ``env.name=`` or of the ``env=`` option
    among ``overrides`` (the option's file is composed to read its name), else the family
    whose entry config is ``config_name``, else ManiSkill's."""
    name = option = None
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        if key == "env.name":
            name = value
        elif key == "env":
            option = value
    if name is None and option is not None:
        from m2flow.configs import ConfigError, load_config, schema
        from m2flow.envs.registry import register_schemas

        register_schemas(schema)
        try:
            name = str(load_config(f"env/{option}").env.name)
        except ConfigError:  # no such option: the entry config's own load names the fix
            name = None
    if name is not None:
        return name.split("/", 1)[0]
    for family in recorders.RECORDERS:
        if config_name and config_name == _default_config(family):
            return family
    return recorders.DEFAULT_FAMILY


def _default_config(family: str) -> Optional[str]:
    try:
        return recorders.recorder(family).DEFAULT_CONFIG
    except ImportError:  # its simulator is not installed: it is not the one asked for
        return None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="m2flow-demos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", "-cn", default=None,
                        help="config in m2flow/configs/demos (default: the env family's: "
                             "'default' for ManiSkill, 'libero' for LIBERO)")
    parser.add_argument("--cfg", action="store_true", help="print the composed config and exit")
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides, e.g. env=maniskill_pushcube_rgb demos.episodes=10")
    args = parser.parse_args(argv)
    from m2flow.configs import ConfigError

    try:
        family = env_family(args.config_name, args.overrides)
        try:
            lib = recorders.recorder(family)
        except KeyError as e:
            raise ConfigError(f"config error: env: {e.args[0]}") from None
        cfg = lib.load_demos_config(args.config_name or lib.DEFAULT_CONFIG, args.overrides)
    except ConfigError as e:
        print(f"m2flow-demos: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.cfg:
        return print_config(cfg)
    stem = lib.output_stem(cfg)
    modes = [m for m in (cfg.env.obs_mode, getattr(cfg.env, "control_mode", None)) if m]
    print(f"m2flow-demos: {cfg.env.name} ({', '.join(modes)}) -> {stem}.h5", flush=True)
    restore, code = signals_as_ctrl_c()
    try:
        demos, tally, spec = lib.generate(cfg, log=lambda line: print(line, flush=True))
    except KeyboardInterrupt:  # while the simulator started: no episode tried yet
        print("m2flow-demos: interrupted during start-up; nothing was written.",
              file=sys.stderr, flush=True)
        return code()
    finally:
        restore()
    if tally.interrupted:  # Ctrl-C or SIGTERM: what was kept is written, and said so
        wrote = "nothing was written"
        if demos:
            wrote = f"wrote {lib.save(stem, demos, cfg.env, spec, tally)[0]} with them"
        print(f"m2flow-demos: interrupted after {tally.tried} episodes tried, {tally.kept} of "
              f"{lib.wanted(cfg)} kept; {wrote}.", file=sys.stderr, flush=True)
        return code()
    h5_path, _ = lib.save(stem, demos, cfg.env, spec, tally)
    print(lib.closing_line(cfg, tally, demos, h5_path), flush=True)
    return 0 if lib.succeeded(cfg, tally) else 1


if __name__ == "__main__":
    sys.exit(main())
