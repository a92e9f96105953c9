"""``m2flow-train`` and ``m2flow-eval``: Hydra-composed configs, errors as one line.

    m2flow-train                                   # the default job (PushCube, PPO, MLP)
    m2flow-train --config-name maniskill_pickcube_ppo_mlp env.num_envs=4
    m2flow-train --cfg                             # print the composed config and exit
    m2flow-eval checkpoint=runs/.../checkpoints/last.pt episodes=50
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

DEFAULT_CONFIG = "maniskill_pushcube_ppo_mlp"


def train(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m2flow-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", "-cn", default=DEFAULT_CONFIG,
                        help=f"entry config in m2flow/configs (default: {DEFAULT_CONFIG})")
    parser.add_argument("--cfg", action="store_true", help="print the composed config and exit")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. env.num_envs=4 cluster=inprocess")
    args = parser.parse_args(argv)
    from m2flow.configs import ConfigError, load_train_config

    try:
        cfg = load_train_config(args.config_name, args.overrides)
    except ConfigError as e:
        print(f"m2flow-train: {e}", file=sys.stderr)
        return 2
    if args.cfg:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        return 0
    _setup_logging()
    from m2flow.embodied.runner import EmbodiedRunner

    runner = EmbodiedRunner(cfg)
    try:
        result = runner.train()
    finally:
        runner.close()
    print(
        f"done: {result['iterations']} iterations, {result['env_steps']} env steps, "
        f"{result['wall_s']:.0f} s; eval success {result.get('eval/success', float('nan')):.3f} "
        f"over {result.get('eval/episodes', 0):.0f} episodes; checkpoint {result['checkpoint']}"
    )
    return 0


def evaluate(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m2flow-eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*",
                        help="checkpoint=PATH [episodes=N] and dotted overrides of the "
                             "checkpoint's config, e.g. env.num_envs=4 cluster.backend=local")
    args = parser.parse_args(argv)
    from m2flow.configs import ConfigError
    from m2flow.embodied.evaluate import eval_config

    try:
        cfg, state = eval_config(args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"m2flow-eval: {e}", file=sys.stderr)
        return 2
    _setup_logging()
    from m2flow.embodied.runner import EmbodiedRunner

    runner = EmbodiedRunner(cfg, train=False)
    try:
        runner.load_policy(state)
        metrics = runner.evaluate(cfg.eval.episodes or cfg.runner.eval_episodes,
                                  deterministic=cfg.eval.deterministic)
    finally:
        runner.close()
    print(
        f"eval: success {metrics.get('eval/success', float('nan')):.3f} over "
        f"{metrics['eval/episodes']:.0f} episodes of {cfg.env.name} "
        f"(return {metrics.get('eval/return', float('nan')):.2f}, "
        f"length {metrics.get('eval/episode_len', float('nan')):.1f})"
    )
    print(json.dumps(metrics))
    return 0


def _setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
