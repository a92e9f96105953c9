"""A name -> implementation table that imports lazily; envs and policies each keep one.

Targets are classes or ``"module:attr"`` strings (imported on first use, so registering costs
no import). Installed packages add names through an entry-point group. A name ending in ``/*``
is a family that serves every ``<prefix>/<anything>``. A class's ``requires`` names the packages
it imports when it runs (a simulator, a model library): ``require`` refuses a name whose
packages are missing in one line with the pip command, ``load`` (settings, schemas) does not.

>>> reg = Registry("thing", "m2flow.things", ValueError)
>>> _ = reg.register("a", "collections:OrderedDict")
>>> reg.load("a").__name__
'OrderedDict'
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import re
from importlib.metadata import entry_points
from typing import Callable, Optional, Union

Target = Union[str, type]


def suggest(name: str, known: list[str]) -> str:
    """' Did you mean X?' for the closest known name, or ''."""
    close = difflib.get_close_matches(name, known, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def schema_name(name: str) -> str:
    """The Hydra schema a registered name's config class is stored as (in its group): the name
    in lower case, a family's ``/*`` dropped, other characters than letters and digits ``_``.

    >>> schema_name("ManiSkill/*"), schema_name("toy/Reach-v0"), schema_name("sac_mlp")
    ('maniskill_schema', 'toy_reach_v0_schema', 'sac_mlp_schema')
    """
    stem = name[:-2] if name.endswith("/*") else name
    return re.sub(r"[^a-z0-9]+", "_", stem.lower()).strip("_") + "_schema"


@dataclasses.dataclass(frozen=True)
class Requires:
    """The packages an implementation imports when it runs, and the pip requirement that adds
    them. Its module imports none of them (so ``import m2flow``, the registry and the config
    schemas work without them); a run that picks it is refused at start-up when one is missing.

    >>> Requires(("json",), "m2flow[x]").check("thing 'a'", ValueError)
    >>> Requires(("json", "no_such_module"), "m2flow[x]").check("thing 'a'", ValueError)
    Traceback (most recent call last):
    ...
    ValueError: thing 'a' needs no_such_module, which is not installed: pip install 'm2flow[x]'.
    """

    modules: tuple[str, ...]
    """Top-level module names (``mani_skill``), looked up without importing them."""
    install: str
    """What ``pip install`` takes: ``m2flow[maniskill]`` for one of m2flow's extras."""

    def check(self, what: str, error: Callable[[str], Exception]) -> None:
        """Raises ``error(line)``, the line naming ``what``, the missing modules and the pip
        command, when one of ``modules`` is not installed."""
        missing = [m for m in self.modules if importlib.util.find_spec(m) is None]
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            raise error(f"{what} needs {', '.join(missing)}, which {verb} not installed: "
                        f"pip install '{self.install}'.")


class Registry:
    """Names of one kind of component; errors are raised as ``error`` (a typed user error)."""

    def __init__(self, kind: str, group: str, error: type, builtins: Optional[dict] = None,
                 base_config: Optional[type] = None):
        self.kind, self.group, self.error = kind, group, error
        self._table: dict[str, Target] = dict(builtins or {})
        self.base_config = base_config
        """The settings of a class that names no ``config_class`` (one written before)."""

    def register(self, name: str, target: Target | None = None, *, override: bool = False):
        """Registers ``target`` under ``name``; without ``target`` it is a decorator."""

        def add(t: Target) -> Target:
            if name in self._table and not override and self._table[name] is not t:
                raise self.error(
                    f"{self.kind} {name!r} is already registered (as {self._table[name]!r}); "
                    "pass override=True to replace it."
                )
            self._table[name] = t
            return t

        return add if target is None else add(target)

    def functions(self) -> tuple[Callable, Callable, Callable, Callable]:
        """(``register``, ``names``, ``load``, ``settings``): what a registry's module exports
        under its kind's names (``register_env, registered_envs, env_class, env_config``).

        >>> reg = Registry("thing", "m2flow.things", ValueError)
        >>> register_thing, registered_things, thing_class, thing_config = reg.functions()
        >>> _ = register_thing("a", "collections:OrderedDict")
        >>> registered_things(), thing_class("a").__name__
        (['a'], 'OrderedDict')
        """
        return self.register, self.names, self.load, self.settings

    def names(self) -> list[str]:
        """Every known name: registered in code plus entry points (nothing is imported)."""
        return sorted(set(self._table) | {ep.name for ep in entry_points(group=self.group)})

    def load(self, name: str):
        """The implementation for ``name`` (imported now); an unknown name lists the known."""
        target = self._lookup(name)
        if not isinstance(target, str):
            return target
        module, _, attr = target.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise self.error(
                f"{self.kind} {name!r} points at {target!r}, which does not import: {e}. "
                "Install the package that provides it."
            ) from e

    def require(self, name: str):
        """``load(name)``, refused in one line (``self.error``) when its class leaves an
        abstract method unimplemented or a package its class's ``requires`` (a
        :class:`Requires`) names is not installed; for a run that is about to build it, not
        for reading its settings class."""
        cls = self.load(name)
        if inspect.isabstract(cls):  # a plugin written for an interface that has grown
            missing = ", ".join(sorted(cls.__abstractmethods__))
            raise self.error(
                f"{self.kind} {name!r} ({cls.__module__}.{cls.__qualname__}) does not implement "
                f"{missing}, which every {self.kind} must; see docs/extending.md.")
        requires = getattr(cls, "requires", None)
        if isinstance(requires, Requires):  # (a class of a plugin may use the name otherwise)
            requires.check(f"{self.kind} {name!r}", self.error)
        return cls

    def store_schemas(self, cs, group: str) -> None:
        """Stores the ``config_class`` of every name that imports in ConfigStore ``cs`` as
        ``<group>/<schema_name(name)>``; a group file extends it with ``defaults:
        [<schema>, _self_]``, so its keys are checked against that class. A name that does not
        import (a plugin's missing dependency) is skipped: it fails when it is chosen."""
        for name in self.names():
            try:
                node = self.config_class(self.load(name))
            except self.error:
                continue
            cs.store(group=group, name=schema_name(name), node=node)

    def config_class(self, cls) -> type:
        """The settings class of implementation ``cls``."""
        return getattr(cls, "config_class", self.base_config)

    def schema_of(self, name: str) -> str:
        """The schema of ``name``'s config class (its family's, for a family member)."""
        return schema_name(self._key(name))

    def settings(self, name: str, **fields):
        """``name``'s config class with ``fields`` (the rest its defaults); a key it lacks is
        one line naming ``name``, the key and the class's keys.

        >>> reg = Registry("thing", "m2flow.things", ValueError)
        >>> @dataclasses.dataclass
        ... class Cfg:
        ...     name: str = ""
        ...     width: int = 1
        >>> _ = reg.register("a", type("A", (), {"config_class": Cfg}))
        >>> reg.settings("a", width=2)
        Cfg(name='a', width=2)
        >>> reg.settings("a", widht=2)
        Traceback (most recent call last):
        ...
        ValueError: thing 'a' has no setting 'widht'. Did you mean 'width'? Its settings (Cfg): name, width.
        """
        cls = self.config_class(self.load(name))
        known = [f.name for f in dataclasses.fields(cls)]
        for key in fields:
            if key not in known:
                raise self.error(f"{self.kind} {name!r} has no setting {key!r}."
                                 f"{suggest(key, known)} Its settings ({cls.__name__}): "
                                 f"{', '.join(known)}.")
        return cls(**{"name": name, **fields})

    def check_settings(self, cfg, cls, field: str) -> None:
        """``self.error`` unless ``cfg`` is (a subclass of) the settings class of ``cls``, the
        implementation of ``cfg.name``: a config group file of another simulator or model,
        given another ``name``, has other settings. ``field``: where ``cfg`` sits."""
        want = self.config_class(cls)
        if not isinstance(cfg, want):
            raise self.error(
                f"{field}.name={cfg.name!r} takes the settings {want.__name__}, but the {field} "
                f"config gives {type(cfg).__name__}; pick the {field}= option written for it "
                f"(its file starts with defaults: [{self.schema_of(cfg.name)}, _self_]).")

    def _lookup(self, name: str) -> Target:
        key = self._key(name)
        if key in self._table:
            return self._table[key]
        return next(ep.value for ep in entry_points(group=self.group) if ep.name == key)

    def _key(self, name: str) -> str:
        """The table key (or entry-point name) that serves ``name``: itself or its family."""
        if name in self._table or any(ep.name == name for ep in entry_points(group=self.group)):
            return name
        family = name.rsplit("/", 1)[0] + "/*" if "/" in name else None
        if family in self._table:
            return family
        known = self.names()
        raise self.error(
            f"Unknown {self.kind} {name!r}. Known: {', '.join(known)}.{suggest(name, known)}"
        )
