"""A name -> implementation table that imports lazily; envs and policies each keep one.

Targets are classes or ``"module:attr"`` strings (imported on first use, so registering costs
no import). Installed packages add names through an entry-point group. A name ending in ``/*``
is a family that serves every ``<prefix>/<anything>``.

>>> reg = Registry("thing", "m2flow.things", ValueError)
>>> _ = reg.register("a", "collections:OrderedDict")
>>> reg.load("a").__name__
'OrderedDict'
"""

from __future__ import annotations

import difflib
import importlib
from importlib.metadata import entry_points
from typing import Optional, Union

Target = Union[str, type]


def suggest(name: str, known: list[str]) -> str:
    """' Did you mean X?' for the closest known name, or ''."""
    close = difflib.get_close_matches(name, known, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


class Registry:
    """Names of one kind of component; errors are raised as ``error`` (a typed user error)."""

    def __init__(self, kind: str, group: str, error: type, builtins: Optional[dict] = None):
        self.kind, self.group, self.error = kind, group, error
        self._table: dict[str, Target] = dict(builtins or {})

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

    def _lookup(self, name: str) -> Target:
        if name in self._table:
            return self._table[name]
        for ep in entry_points(group=self.group):
            if ep.name == name:
                return ep.value
        family = name.rsplit("/", 1)[0] + "/*" if "/" in name else None
        if family in self._table:
            return self._table[family]
        known = self.names()
        raise self.error(
            f"Unknown {self.kind} {name!r}. Known: {', '.join(known)}.{suggest(name, known)}"
        )
