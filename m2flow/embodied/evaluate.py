"""Evaluation config: a checkpoint's own config, with the user's overrides on top."""

from __future__ import annotations

from typing import Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from m2flow.configs.loader import ConfigError, check_names, explain, to_object
from m2flow.embodied import checkpoint
from m2flow.embodied.config import TrainConfig

SHORTHANDS = {"checkpoint": "eval.checkpoint", "episodes": "eval.episodes"}


def eval_config(overrides: Sequence[str]) -> tuple[TrainConfig, dict]:
    """(config, checkpoint state) for ``m2flow-eval checkpoint=PATH [episodes=N] [key=value...]``."""
    dotlist = []
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if not sep:
            raise ConfigError(f"config error: {ov!r} is not key=value (e.g. checkpoint=path.pt).")
        dotlist.append(f"{SHORTHANDS.get(key, key)}={value}")
    given = OmegaConf.from_dotlist(dotlist)
    path = OmegaConf.select(given, "eval.checkpoint")
    if not path:
        raise ConfigError("config error: checkpoint is missing; run m2flow-eval checkpoint=PATH.")
    state = checkpoint.load(path)
    try:
        cfg = OmegaConf.merge(
            OmegaConf.structured(TrainConfig), OmegaConf.create(state["config"]), given
        )
    except OmegaConfBaseException as e:
        raise ConfigError(explain(e, "")) from None
    obj = to_object(cfg)
    check_names(obj)
    return obj, state
