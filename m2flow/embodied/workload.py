"""The embodied workload as the command line sees it: schemas, checks, train and evaluate."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Optional

from m2flow.configs import schema
from m2flow.embodied.config import TrainConfig
from m2flow.runs.control import RunControl
from m2flow.runs.workload import Workload


def register_schemas() -> None:
    """The root schema and one schema per registered algorithm, env adapter and policy (groups
    ``algorithm``, ``env``, ``policy``); ``policy.kwargs`` and ``env.kwargs``, gone, and the
    env staging's keys of their old section ``rollout`` (``rollout.pipeline_stages``; the
    reasoning workload's ``rollout`` is its generation) are named as such when a config or
    override still sets them."""
    from m2flow.embodied.algorithms import register_schemas as register_algorithms
    from m2flow.envs.registry import register_schemas as register_envs
    from m2flow.policies.registry import register_schemas as register_policies

    schema.store("train_schema", TrainConfig)
    for register in (register_algorithms, register_envs, register_policies):
        register(_Store())
    for group in ("env", "policy"):
        schema.retire(f"{group}.kwargs", group)
    for key in ("pipeline_stages", "env_groups"):
        schema.rename(f"rollout.{key}", f"staging.{key}")


class _Store:
    """A ConfigStore's ``store`` that also lets error messages list the fields."""

    @staticmethod
    def store(name: str, node: type, group=None) -> None:
        schema.store(name, node, group=group)


def typed_base(saved):
    """TrainConfig's defaults with ``algorithm``, ``env`` and ``policy`` typed by the saved
    names' own config classes, so a checkpoint's GRPO fields merge onto GRPOConfig and its
    LIBERO settings onto LiberoEnvConfig, not onto the base classes."""
    from omegaconf import OmegaConf

    from m2flow.embodied.algorithms import ALGORITHMS
    from m2flow.envs.registry import ENVS
    from m2flow.policies.registry import POLICIES

    base = OmegaConf.structured(TrainConfig)
    for group, registry in (("algorithm", ALGORITHMS), ("env", ENVS), ("policy", POLICIES)):
        name = OmegaConf.select(saved, f"{group}.name")
        if name:
            base[group] = OmegaConf.structured(registry.config_class(registry.load(name)))
    return base


def check(cfg: TrainConfig) -> None:
    from m2flow.embodied.checks import check_train_config

    check_train_config(cfg)


def memory_hint(cfg: TrainConfig) -> str:
    from m2flow.embodied.checks import memory_hint as hint
    from m2flow.embodied.layout import Layout

    return hint(Layout.of(cfg), cfg)


def train(cfg: TrainConfig, control: Optional[RunControl] = None) -> int:
    from m2flow.embodied.runner import EmbodiedRunner

    runner = EmbodiedRunner(cfg, control=control)
    try:
        result = runner.train()
    finally:
        runner.close()
    print(
        f"done: {result['iterations']} iterations, {result['env_steps']} env steps, "
        f"{result['wall_s']:.0f} s; eval success_once "
        f"{result.get('eval/success_once', float('nan')):.3f} success_at_end "
        f"{result.get('eval/success_at_end', float('nan')):.3f} return "
        f"{result.get('eval/return', float('nan')):.2f} over "
        f"{result.get('eval/episodes', 0):.0f} episodes; checkpoint {result['checkpoint']}"
    )
    return 0


def evaluate(cfg: TrainConfig, state: Optional[dict],
             control: Optional[RunControl] = None) -> int:
    """N episodes per task (the eval protocol), a report and videos. Stopped by Ctrl-C or
    SIGTERM (``run_protocol``'s ``interrupted``), it writes the episodes of the rounds it
    completed as a partial report (none: no report) and raises ``EvalInterrupted``, whose
    line says how many episodes of how many it kept and where. Ended by a failure (a worker
    that died, one killed for memory), it does the same and raises ``EvalFailed``: the
    failure's line, with what was kept."""
    from m2flow.embodied.eval_protocol import run_protocol
    from m2flow.embodied.eval_report import write_report
    from m2flow.embodied.runner import EmbodiedRunner
    from m2flow.runs.failure import EvalFailed, EvalInterrupted

    runner = EmbodiedRunner(cfg, train=False, control=control)
    try:
        if state is not None:  # else: the rollout workers built the seed's initial weights
            runner.load_policy(state)
        report = run_protocol(runner, cfg, progress=cfg.runner.progress_bar)
    finally:
        runner.close()
    out_dir = _eval_dir(cfg)
    failure = report.pop("_failure")
    if failure is not None:  # a worker died (or was killed for memory): keep what was counted
        if report["per_episode"]:
            write_report(report, out_dir)
        raise EvalFailed(failure, report["episodes"], report["episodes_asked"],
                         out_dir if report["per_episode"] else None)
    if report["interrupted"]:
        if report["per_episode"]:
            write_report(report, out_dir)
        raise EvalInterrupted(report["episodes"], report["episodes_asked"],
                              out_dir if report["per_episode"] else None)
    paths = write_report(report, out_dir)
    print(paths["markdown"].read_text())
    print(f"eval: mean success_once {report['mean_success_once']:.3f} success_at_end "
          f"{report['mean_success_at_end']:.3f} over {len(report['tasks'])} task(s), "
          f"{report['episodes']} episodes of {cfg.env.name} in {report['wall_s']:.0f} s "
          f"({report['discarded']} discarded); report in {out_dir}")
    n = max(1, report["episodes"])
    print(json.dumps({
        "eval/episodes": float(report["episodes"]),
        "eval/success_once": report["mean_success_once"],
        "eval/success_at_end": report["mean_success_at_end"],
        "eval/return": sum(t["mean_return"] * t["episodes"] for t in report["tasks"]) / n,
        "eval/episode_len": sum(t["mean_length"] * t["episodes"] for t in report["tasks"]) / n,
        "eval/discarded_episodes": float(report["discarded"]),
    }))
    return 0


def _eval_dir(cfg: TrainConfig) -> Path:
    if cfg.eval.output_dir:
        return Path(cfg.eval.output_dir)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    if cfg.eval.checkpoint:  # next to the run that wrote the checkpoint
        return Path(cfg.eval.checkpoint).resolve().parent.parent / "eval" / stamp
    return Path(cfg.runner.log_dir) / "eval" / cfg.env.name.replace("/", "_") / stamp


WORKLOAD = Workload(
    name="embodied",
    schema="train_schema",
    config_class=TrainConfig,
    register_schemas=register_schemas,
    check=check,
    train=train,
    evaluate=evaluate,
    memory_hint=memory_hint,
    typed_base=typed_base,
    eval_shorthands={
        "episodes": "eval.episodes",
        "episodes_per_task": "eval.episodes_per_task",
        "first_episode": "eval.first_episode",
        "max_steps": "eval.max_steps",
        "videos_per_task": "eval.videos_per_task",
        "deterministic": "eval.deterministic",
    },
)
