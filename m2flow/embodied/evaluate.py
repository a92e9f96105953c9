"""Evaluation config: a checkpoint's own config, with the user's overrides on top."""

from __future__ import annotations

from importlib.resources import files
from typing import Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from m2flow.configs.loader import (
    ConfigError,
    check_names,
    check_reasoning,
    explain,
    load_run_config,
    to_object,
)
from m2flow.embodied import checkpoint
from m2flow.embodied.config import TrainConfig

SHORTHANDS = {
    "checkpoint": "eval.checkpoint",
    "episodes": "eval.episodes",
    "episodes_per_task": "eval.episodes_per_task",
    "max_steps": "eval.max_steps",
    "videos_per_task": "eval.videos_per_task",
    "output_dir": "eval.output_dir",
    "deterministic": "eval.deterministic",
    "size": "eval.size",
    "samples": "eval.samples",
}
DEFAULT_EVAL_CONFIG = "eval"  # m2flow/configs/eval.yaml


def eval_config(overrides: Sequence[str]) -> tuple[TrainConfig, Optional[dict]]:
    """(config, checkpoint state or None) for ``m2flow-eval``:

    - ``checkpoint=PATH [key=value ...]``: the checkpoint's own config, overrides on top;
    - otherwise a Hydra-composed config (entry config ``config=NAME``, default ``eval``) with
      the policy's initial weights: ``m2flow-eval env=libero_spatial policy=cnn``.
    """
    pairs = []
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if not sep:
            raise ConfigError(f"config error: {ov!r} is not key=value (e.g. checkpoint=path.pt).")
        pairs.append((key, value))
    if not any(k in ("checkpoint", "eval.checkpoint") for k, _ in pairs):
        name = next((v for k, v in pairs if k == "config"), DEFAULT_EVAL_CONFIG)
        rest = [f"{SHORTHANDS.get(k, k)}={v}" for k, v in pairs if k != "config"]
        return load_run_config(name, rest), None
    dotlist, groups = [], []
    for key, value in pairs:
        if key == "config":
            raise ConfigError("config error: config=NAME starts from an entry config; with "
                              "checkpoint=PATH the checkpoint's own config is used. Drop one.")
        if key in GROUPS:
            groups.append(_group_option(key, value))
        else:
            dotlist.append(f"{SHORTHANDS.get(key, key)}={value}")
    given = OmegaConf.merge(*groups, OmegaConf.from_dotlist(dotlist))
    path = OmegaConf.select(given, "eval.checkpoint")
    if not path:
        raise ConfigError("config error: checkpoint is missing; run m2flow-eval checkpoint=PATH.")
    state = checkpoint.load(path)
    reasoning = state.get("workload") == "reasoning"
    if reasoning:
        from m2flow.reasoning.config import ReasoningConfig as schema
    else:
        schema = TrainConfig
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.create(state["config"]), given)
    except OmegaConfBaseException as e:
        raise ConfigError(explain(e, "")) from None
    obj = to_object(cfg)
    check_reasoning(obj) if reasoning else check_names(obj)
    return obj, state


GROUPS = ("env", "policy", "algorithm", "cluster", "runner")


def _group_option(group: str, option: str):
    """``cluster=inprocess`` -> the YAML of that group option, placed under its group key."""
    path = files("m2flow.configs") / group / f"{option}.yaml"
    if not path.is_file():
        known = sorted(p.name[:-5] for p in (files("m2flow.configs") / group).iterdir()
                       if p.name.endswith(".yaml"))
        raise ConfigError(
            f"config error: {group}={option}: no such option. Available: {', '.join(known)}."
        )
    return OmegaConf.create({group: OmegaConf.create(path.read_text()) or {}})
