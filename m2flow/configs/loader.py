"""Composes a config with Hydra and turns every mistake into one sentence naming the field.

>>> cfg = load_train_config("maniskill_pushcube_ppo_mlp", ["env.num_envs=2"])
>>> cfg.env.num_envs
2
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Sequence

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from m2flow.configs import schema


class ConfigError(ValueError):
    """A config that does not fit the schema, or names something that does not exist."""


PLUGIN_GROUP = "m2flow.configs"
"""Entry points naming packages whose config groups join m2flow's (e.g. a plugin's
``env/<option>.yaml``, then ``env=<option>``)."""


def load_config(config_name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The composed config (typed DictConfig), or a ConfigError naming the bad field."""
    schema.register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module("m2flow.configs", version_base="1.3"):
            return compose(config_name=config_name,
                           overrides=plugin_search_path(overrides) + list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(explain(e, config_name)) from None
    finally:
        GlobalHydra.instance().clear()


def plugin_search_path(overrides: Sequence[str]) -> list[str]:
    """A ``hydra.searchpath`` override with every plugin's config package (none if the user
    sets the search path, or no plugin is installed)."""
    from importlib.metadata import entry_points

    if any(o.lstrip("+~").startswith("hydra.searchpath") for o in overrides):
        return []
    paths = [f"pkg://{ep.value}" for ep in entry_points(group=PLUGIN_GROUP)]
    return [f"hydra.searchpath=[{','.join(paths)}]"] if paths else []


def load_train_config(config_name: str, overrides: Sequence[str] = ()):
    """The composed config as a ``TrainConfig`` object, with env and policy names checked."""
    from m2flow.embodied.config import TrainConfig

    obj = load_run_config(config_name, overrides)
    if not isinstance(obj, TrainConfig):
        raise ConfigError(
            f"config error: {config_name!r} is a {obj.workload} config, not an embodied one; "
            "run it with m2flow-train --config-name " + config_name + "."
        )
    return obj


def load_run_config(config_name: str, overrides: Sequence[str] = ()):
    """Any entry config as its object: a ``TrainConfig`` (embodied) or a ``ReasoningConfig``,
    with names checked."""
    from m2flow.reasoning.config import ReasoningConfig

    cfg = load_config(config_name, overrides)
    obj = to_object(cfg)
    if isinstance(obj, ReasoningConfig):
        check_reasoning(obj)
    else:
        check_names(obj)
    return obj


def check_reasoning(cfg) -> None:
    """Engine, reward and data source names at startup."""
    from m2flow.reasoning.engine import ENGINES
    from m2flow.reasoning.reward import REWARDS

    checks = [
        ("rollout.engine", cfg.rollout.engine, sorted(ENGINES)),
        ("algorithm.reward", cfg.algorithm.reward, sorted(REWARDS)),
        ("data.source", cfg.data.source, ["arithmetic", "jsonl", "parquet"]),
        ("model.dtype", cfg.model.dtype, ["auto", "float32", "bfloat16", "float16"]),
    ]
    for field, value, known in checks:
        if value not in known:
            raise ConfigError(f"config error: {field}={value!r} is not one of {known}.")
    if cfg.model.path is not None and not (Path(cfg.model.path).expanduser() / "config.json").is_file():
        raise ConfigError(
            f"config error: model.path={cfg.model.path!r} is not a local Hugging Face model "
            "directory (no config.json there); point it at one, or set model.path=null for "
            "the tiny preset."
        )


def to_object(cfg: DictConfig):
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(explain(e, "")) from None


def check_names(cfg) -> None:
    """Registry lookups at startup, not 300 lines into a rollout."""
    from m2flow.envs import EnvError, env_class
    from m2flow.policies import PolicyError
    from m2flow.policies.registry import policy_class

    try:
        cls = env_class(cfg.env.name)
        check = getattr(cls, "check_config", None)
        if check is not None:
            check(cfg.env)
    except EnvError as e:
        raise ConfigError(f"config error: {e}") from None
    try:
        policy_class(cfg.policy.name)
    except PolicyError as e:
        raise ConfigError(f"config error: policy.name: {e}") from None


def entry_configs() -> list[str]:
    """Names of the entry configs shipped in m2flow/configs (what --config-name accepts)."""
    from importlib.resources import files

    return sorted(p.name[:-5] for p in files("m2flow.configs").iterdir() if p.name.endswith(".yaml"))


def explain(e: Exception, config_name: str) -> str:
    """One line from a Hydra/OmegaConf error: the field, what is wrong, how to fix it."""
    inner = e
    while inner.__cause__ is not None and isinstance(inner.__cause__, Exception):
        inner = inner.__cause__
    text = str(inner)
    first = text.strip().splitlines()[0] if text.strip() else type(inner).__name__
    full_key = getattr(inner, "full_key", None) or _grab(r"full_key: (\S+)", text)
    m = re.match(r"Key '([^']+)' not in '([^']+)'", first)
    if m:
        key, owner = m.groups()
        known = _fields_of(owner)
        hint = difflib.get_close_matches(key, known, n=1)
        where = full_key or key
        parent = where.rsplit(".", 1)[0] + "." if "." in where else ""
        return (
            f"config error: {where} is not a field of {owner}."
            + (f" Did you mean {parent}{hint[0]}?" if hint else "")
            + (f" Known fields: {', '.join(known)}." if known else "")
        )
    m = re.search(r"Value '([^']*)' of type '([^']+)' could not be converted to (\w+)", text)
    if m and full_key:
        value, _, target = m.groups()
        return f"config error: {full_key}={value!r} is not of type {target}; give a {target} value."
    if "Could not find" in first or "Could not load" in first:
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        known = f" Available: {', '.join(options)}." if options else ""
        return f"config error: {first}.{known}"
    if "Cannot find primary config" in first:
        return (
            f"config error: there is no entry config {config_name!r}. Available: "
            f"{', '.join(entry_configs())}."
        )
    if full_key:
        return f"config error: {full_key}: {first}"
    return f"config error: {first}"


def _grab(pattern: str, text: str):
    m = re.search(pattern, text)
    return m.group(1) if m else None


def _fields_of(owner: str) -> list[str]:
    import dataclasses

    from m2flow.embodied import config as ec
    from m2flow.embodied import ppo
    from m2flow.envs import config as envc
    from m2flow.pipelines import cluster, placement
    from m2flow.policies import config as pc
    from m2flow.reasoning import config as rc

    for mod in (ec, ppo, envc, cluster, placement, pc, rc):
        cls = getattr(mod, owner, None)
        if cls is not None and dataclasses.is_dataclass(cls):
            return [f.name for f in dataclasses.fields(cls)]
    return []
