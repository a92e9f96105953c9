"""Composes a config with Hydra and turns every mistake into one sentence naming the field.

Knows no workload: the caller registers the schemas (``m2flow.configs.schema.store``) first;
``m2flow.cli.workloads`` does that for every workload.
"""

from __future__ import annotations

import difflib
import re
from typing import Optional, Sequence

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
    check_retired(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module("m2flow.configs", version_base="1.3"):
            all_overrides = plugin_search_path(overrides) + list(overrides)
            try:
                return compose(config_name=config_name, overrides=all_overrides)
            except (HydraException, OmegaConfBaseException) as e:
                raise ConfigError(retired_in_file(e, all_overrides) or explain(e, config_name)
                                  ) from None
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(explain(e, config_name)) from None
    finally:
        GlobalHydra.instance().clear()


def retired_in_file(e: Exception, overrides: Sequence[str]) -> Optional[str]:
    """:func:`m2flow.configs.schema.retired_line` for a config file that sets a retired key
    (``policy.kwargs:``), naming the file and the fields its entries are now; None for any
    other error. Reads the file through the running Hydra's search path."""
    text = str(e)
    where = re.match(r"In '([^']+)'", text)
    key = _grab(r"full_key: (\S+)", text)
    if where is None or key is None or not schema.retired_line(key):
        return None
    path = where.group(1)
    group, _, leaf = key.rpartition(".")
    try:
        loader = GlobalHydra.instance().config_loader()
        _, repo = loader._parse_overrides_and_create_caching_repo(None, list(overrides))
        node = repo.load_config(path).config
        if not path.startswith(f"{group}/"):  # an entry config: under the group's key
            node = node.get(group) or {}
        entries = list(node.get(leaf) or [])
    except Exception:  # noqa: BLE001 - the line without the entries is still the right one
        entries = []
    return schema.retired_line(key, entries, path)


def sweep_jobs(overrides: Sequence[str]) -> list[list[str]]:
    """The jobs of a multirun: Hydra's own expansion of ``overrides`` (its ``BasicSweeper``:
    the cartesian product of every sweep, ``seed=0,1,2``, ``lr=range(1,4)``,
    ``env=glob(gym_*)``), each job a list of overrides; ``hydra.*`` overrides are left out
    (they set up the sweep, not a job). Errors as one line.

    >>> sweep_jobs(["seed=0,1", "algorithm.learning_rate=1e-4", "env.num_envs=2,4"])[1]
    ['seed=0', 'algorithm.learning_rate=0.0001', 'env.num_envs=4']
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    GlobalHydra.instance().clear()
    try:
        with initialize_config_module("m2flow.configs", version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()  # lists a group's options for glob()
            parsed = OverridesParser.create(config_loader=loader).parse_overrides(list(overrides))
            jobs = BasicSweeper.split_arguments([o for o in parsed if not o.is_hydra_override()],
                                                None)[0]
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(explain(e, "")) from None
    finally:
        GlobalHydra.instance().clear()
    return [list(job) for job in jobs]


def sweeps(overrides: Sequence[str]) -> list[str]:
    """The overrides among ``overrides`` that sweep (give several values); [] when none does,
    or when one does not parse (composing it reports that)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except (HydraException, OmegaConfBaseException):
        return []
    return [o.input_line for o in parsed if o.is_sweep_override()]


def multirun(config_name: str, task_function, overrides: Sequence[str]) -> list:
    """Hydra's multirun of entry config ``config_name``: its sweeper expands ``overrides``
    and its launcher (``hydra/launcher``: the basic one runs jobs one after the other, a
    launcher plugin such as joblib in parallel) calls ``task_function(cfg)`` once per job,
    each with its own output folder under ``hydra.sweep.dir``. Returns every job's
    ``hydra.core.utils.JobReturn``, in job order; errors before the first job as one line."""
    check_retired(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module("m2flow.configs", version_base="1.3",
                                      job_name="m2flow-train"):
            batches = GlobalHydra.instance().hydra.multirun(
                config_name, task_function, plugin_search_path(overrides) + list(overrides),
                with_log_configuration=False)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(explain(e, config_name)) from None
    finally:
        GlobalHydra.instance().clear()
    return [ret for batch in batches for ret in batch]


def check_retired(overrides: Sequence[str]) -> None:
    """ConfigError (:func:`m2flow.configs.schema.retired_line`) for an override of a key that
    is gone (``policy.kwargs.critic=...``), before Hydra says only that it does not exist."""
    for o in overrides:
        line = schema.retired_line(o.lstrip("+~").partition("=")[0])
        if line:
            raise ConfigError(line)


def plugin_search_path(overrides: Sequence[str]) -> list[str]:
    """A ``hydra.searchpath`` override with every plugin's config package (none if the user
    sets the search path, or no plugin is installed)."""
    from importlib.metadata import entry_points

    if any(o.lstrip("+~").startswith("hydra.searchpath") for o in overrides):
        return []
    paths = [f"pkg://{ep.value}" for ep in entry_points(group=PLUGIN_GROUP)]
    return [f"hydra.searchpath=[{','.join(paths)}]"] if paths else []


def to_object(cfg: DictConfig):
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(explain(e, "")) from None


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
    m = re.search(r"Key '([^']+)' not in '([^']+)'", text)
    if m:
        key, owner = m.groups()
        where = full_key or key
        retired = schema.retired_line(where)
        if retired:
            return retired
        known = _fields_of(owner)
        hint = difflib.get_close_matches(key, known, n=1)
        parent = where.rsplit(".", 1)[0] + "." if "." in where else ""
        return (
            f"config error: {where} is not a field of {owner}{_named(inner, where)}."
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


def _named(error: Exception, where: str) -> str:
    """`` (env ManiSkill/PushCube-v1)`` when the node at fault is a config group's with a
    ``name`` (an env's, a policy's, an algorithm's: whose settings these are), else ''."""
    node = getattr(error, "parent_node", None)
    if where.count(".") != 1 or not isinstance(node, DictConfig):
        return ""
    try:
        name = node.get("name")
    except OmegaConfBaseException:  # a missing name
        return ""
    return f" ({where.split('.')[0]} {name})" if isinstance(name, str) else ""


def _grab(pattern: str, text: str):
    m = re.search(pattern, text)
    return m.group(1) if m else None


def _fields_of(owner: str) -> list[str]:
    import dataclasses

    cls = schema.dataclass_named(owner)
    return [f.name for f in dataclasses.fields(cls)] if cls is not None else []


def group_option(group: str, option: str) -> DictConfig:
    """``cluster=inprocess`` -> the YAML of that group option, placed under its group key
    (for merging onto a config that was not composed by Hydra, e.g. a checkpoint's)."""
    from importlib.resources import files

    path = files("m2flow.configs") / group / f"{option}.yaml"
    if not path.is_file():
        known = sorted(p.name[:-5] for p in (files("m2flow.configs") / group).iterdir()
                       if p.name.endswith(".yaml"))
        raise ConfigError(
            f"config error: {group}={option}: no such option. Available: {', '.join(known)}."
        )
    node = OmegaConf.create(path.read_text()) or OmegaConf.create({})
    node.pop("defaults", None)  # a group's schema line: the checkpoint's config already has it
    return OmegaConf.create({group: node})


def merge_onto(base, *configs) -> DictConfig:
    """``configs`` merged in order onto ``base`` (a schema dataclass, whose defaults are used,
    or a typed DictConfig); errors as one line."""
    try:
        if isinstance(base, type):
            base = OmegaConf.structured(base)
        return OmegaConf.merge(base, *configs)
    except OmegaConfBaseException as e:
        raise ConfigError(explain(e, "")) from None
