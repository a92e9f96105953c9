"""The policy registry: names -> ``"module:Class"`` or classes, imported on lookup.

Classes are called as ``cls(cfg, env_spec)``. Same rules as the env registry: a decorator
``@register_policy("name")``, ``override=True`` to replace, and entry points in group
``m2flow.policies``.
"""

from __future__ import annotations

import difflib
import importlib
from importlib.metadata import entry_points
from typing import Union

from m2flow.policies.base import Policy, PolicyError
from m2flow.policies.config import PolicyConfig

ENTRY_POINT_GROUP = "m2flow.policies"

Target = Union[str, type]
_REGISTRY: dict[str, Target] = {
    "mlp": "m2flow.policies.mlp:GaussianMLPPolicy",
}


def register_policy(name: str, target: Target | None = None, *, override: bool = False):
    """Registers ``target`` (a class or ``"module:Class"``) under ``name``; usable as decorator."""

    def add(t: Target) -> Target:
        if name in _REGISTRY and not override and _REGISTRY[name] is not t:
            raise PolicyError(
                f"policy {name!r} is already registered (as {_REGISTRY[name]!r}); pass "
                "override=True to replace it."
            )
        _REGISTRY[name] = t
        return t

    return add if target is None else add(target)


def registered_policies() -> list[str]:
    return sorted(set(_REGISTRY) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def make_policy(cfg: PolicyConfig, env_spec) -> Policy:
    """Builds policy ``cfg.name`` for an env with ``env_spec``."""
    target = _REGISTRY.get(cfg.name)
    if target is None:
        target = next(
            (ep.value for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == cfg.name), None
        )
    if target is None:
        known = registered_policies()
        close = difflib.get_close_matches(cfg.name, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise PolicyError(f"Unknown policy {cfg.name!r}. Known: {', '.join(known)}.{hint}")
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
    return target(cfg, env_spec)
