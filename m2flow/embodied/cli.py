"""``m2flow-train`` and ``m2flow-eval``: Hydra-composed configs, errors as one line.

    m2flow-train                                   # the default job (PushCube, PPO, MLP)
    m2flow-train --config-name maniskill_pickcube_ppo_mlp env.num_envs=4
    m2flow-train --cfg                             # print the composed config and exit
    m2flow-eval checkpoint=runs/.../checkpoints/last.pt episodes=50
    m2flow-eval env=libero_spatial policy=cnn episodes_per_task=2
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import datetime
from pathlib import Path

DEFAULT_CONFIG = "maniskill_pushcube_ppo_mlp"


def train(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m2flow-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", "-cn", default=DEFAULT_CONFIG,
                        help=f"entry config in m2flow/configs (default: {DEFAULT_CONFIG})")
    parser.add_argument("--cfg", action="store_true", help="print the composed config and exit")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. env.num_envs=4 cluster=inprocess")
    args = parser.parse_args(argv)
    from m2flow.configs import ConfigError, load_run_config

    try:
        cfg = load_run_config(args.config_name, args.overrides)
    except ConfigError as e:
        print(f"m2flow-train: {e}", file=sys.stderr)
        return 2
    if args.cfg:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        return 0
    _setup_logging()
    if getattr(cfg, "workload", "embodied") == "reasoning":
        from m2flow.reasoning.cli import train_reasoning

        return train_reasoning(cfg)
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
    parser = argparse.ArgumentParser(prog="m2flow-eval", description=EVAL_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*",
                        help="checkpoint=PATH or config groups (env=..., policy=...), "
                             "episodes_per_task=N, videos_per_task=K, and dotted overrides")
    args = parser.parse_args(argv)
    from m2flow.configs import ConfigError
    from m2flow.embodied.evaluate import eval_config

    try:
        cfg, state = eval_config(args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"m2flow-eval: {e}", file=sys.stderr)
        return 2
    _setup_logging()
    if getattr(cfg, "workload", "embodied") == "reasoning":
        from m2flow.reasoning.cli import evaluate_reasoning

        return evaluate_reasoning(cfg, state)
    from m2flow.embodied.eval_tasks import evaluate_tasks, write_report
    from m2flow.embodied.runner import EmbodiedRunner

    runner = EmbodiedRunner(cfg, train=False)
    try:
        if state is not None:
            runner.load_policy(state)
        else:
            runner.init_policy()
        report = evaluate_tasks(runner, cfg, progress=cfg.runner.progress_bar)
    finally:
        runner.close()
    out_dir = _eval_dir(cfg)
    paths = write_report(report, out_dir)
    print(paths["markdown"].read_text())
    print(f"eval: mean success {report['mean_success']:.3f} over {len(report['tasks'])} task(s), "
          f"{report['episodes']} episodes of {cfg.env.name} in {report['wall_s']:.0f} s "
          f"({report['discarded']} discarded); report in {out_dir}")
    n = max(1, report["episodes"])
    print(json.dumps({
        "eval/episodes": float(report["episodes"]),
        "eval/success": report["mean_success"],
        "eval/return": sum(t["mean_return"] * t["episodes"] for t in report["tasks"]) / n,
        "eval/episode_len": sum(t["mean_length"] * t["episodes"] for t in report["tasks"]) / n,
        "eval/discarded_episodes": float(report["discarded"]),
    }))
    return 0


EVAL_HELP = """m2flow-eval: N episodes per task of any registered env, with a checkpoint or a policy
config's initial weights; writes results.json, results.md and MP4 videos.

    m2flow-eval checkpoint=runs/.../checkpoints/last.pt episodes=64
    m2flow-eval env=libero_spatial policy=cnn episodes_per_task=2 videos_per_task=1
    m2flow-eval config=libero_spatial_ppo_cnn episodes_per_task=50
    m2flow-eval checkpoint=runs/reasoning_arith_grpo_tiny/.../checkpoints/last.pt size=200
"""


def _eval_dir(cfg) -> Path:
    if cfg.eval.output_dir:
        return Path(cfg.eval.output_dir)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    if cfg.eval.checkpoint:  # next to the run that wrote the checkpoint
        return Path(cfg.eval.checkpoint).resolve().parent.parent / "eval" / stamp
    return Path(cfg.runner.log_dir) / "eval" / cfg.env.name.replace("/", "_") / stamp


def _setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
