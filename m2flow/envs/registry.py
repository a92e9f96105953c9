"""The env registry: names -> adapters, imported lazily.

Three ways in, all ending in the same table:

- ``@register_env("MySim/Task-v1")`` on a class in code that is imported;
- ``register_env("MySim/Task-v1", "my_pkg.envs:TaskEnv")``: a string, imported on first use;
- an entry point in group ``m2flow.envs`` of an installed package (``name = "module:Class"``),
  so another package adds a simulator without touching m2flow.

A name ending in ``/*`` is a family: ``ManiSkill/*`` serves ``ManiSkill/PushCube-v1``, and the
adapter gets the full name. The class is called as ``cls(cfg, device=...)``. A family's class
lists ``EXAMPLE_IDS`` so tests that sweep the registry know which concrete ids to build.
"""

from __future__ import annotations

import difflib
import importlib
from importlib.metadata import entry_points
from typing import Union

from m2flow.envs.base import BatchedEnv, EnvError
from m2flow.envs.config import EnvConfig

ENTRY_POINT_GROUP = "m2flow.envs"

Target = Union[str, type]
_REGISTRY: dict[str, Target] = {
    "ManiSkill/*": "m2flow.envs.maniskill:ManiSkillEnv",
    "gym/*": "m2flow.envs.gymnasium_env:GymnasiumEnv",
}


def register_env(name: str, target: Target | None = None, *, override: bool = False):
    """Registers ``target`` (a class or ``"module:Class"``) under ``name``; usable as decorator."""

    def add(t: Target) -> Target:
        if name in _REGISTRY and not override and _REGISTRY[name] is not t:
            raise EnvError(
                f"env {name!r} is already registered (as {_REGISTRY[name]!r}); pass "
                "override=True to replace it."
            )
        _REGISTRY[name] = t
        return t

    return add if target is None else add(target)


def registered_envs() -> list[str]:
    """Every known name: registered in code plus entry points (nothing is imported)."""
    return sorted(set(_REGISTRY) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def env_class(name: str) -> type:
    """The adapter class for ``name``; an unknown name lists the known ones."""
    target = _lookup(name)
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        try:
            target = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise EnvError(
                f"env {name!r} points at {target!r}, which does not import: {e}. Install the "
                "package that provides it."
            ) from e
    return target


def make_env(cfg: EnvConfig, device: str = "cpu") -> BatchedEnv:
    """Builds the env ``cfg.name`` describes, on ``device`` when its simulator can use one."""
    return env_class(cfg.name)(cfg, device=device)


def _lookup(name: str) -> Target:
    if name in _REGISTRY:
        return _REGISTRY[name]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.value
    family = name.rsplit("/", 1)[0] + "/*" if "/" in name else None
    if family in _REGISTRY:
        return _REGISTRY[family]
    known = registered_envs()
    raise EnvError(f"Unknown env {name!r}. Known: {', '.join(known)}.{suggest(name, known)}")


def suggest(name: str, known: list[str]) -> str:
    """' Did you mean X?' for the closest known name, or ''."""
    close = difflib.get_close_matches(name, known, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""
