"""Schemas in Hydra's ConfigStore, so every YAML and override is type-checked.

The schemas come from the layers that own them (a workload's root config, an algorithm's,
an env adapter's or a policy's settings); this module only stores them and remembers every
dataclass reachable from them, so that an error message can list the fields of the class at
fault, and the keys a workload retired (``policy.kwargs``) or renamed
(``rollout.pipeline_stages``), so that one that is still set is named with its new spelling.
It imports no workload.

Defaults live only in the dataclasses; YAML files set what differs from them.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Optional, Sequence

from hydra.core.config_store import ConfigStore

_DATACLASSES: dict[str, type] = {}
_RETIRED: dict[str, str] = {}
_RENAMED: dict[str, str] = {}


def store(name: str, node: type, group: Optional[str] = None) -> None:
    """Stores dataclass ``node`` as schema ``name`` (in config group ``group``)."""
    ConfigStore.instance().store(name=name, node=node, group=group)
    _remember(node)


def dataclass_named(name: str) -> Optional[type]:
    """The stored (or nested) config dataclass called ``name``, if any."""
    return _DATACLASSES.get(name)


def retire(key: str, parent: str) -> None:
    """Remembers that ``key`` (``policy.kwargs``) is gone and its entries are fields of
    ``parent`` (``policy``) now: a config or override that still sets it fails with
    :func:`retired_line` instead of a bare unknown-field error."""
    _RETIRED[key] = parent


def rename(old: str, new: str) -> None:
    """Remembers that key ``old`` (``rollout.pipeline_stages``) is called ``new``
    (``staging.pipeline_stages``) now: an override or config that still sets it fails with
    :func:`retired_line` naming the new key instead of a bare unknown-field error."""
    _RENAMED[old] = new


def retired_line(key: str, entries: Sequence[str] = (), where: str = "") -> Optional[str]:
    """The one config-error line for ``key`` when it is, or lies under, a retired or renamed
    key; None otherwise. ``entries``: what a config file (``where``) sets under the retired
    key itself.

    >>> retire("policy.kwargs", "policy")
    >>> retired_line("policy.kwargs.critic")
    'config error: policy.kwargs is gone: its entries are fields of policy now; write policy.critic instead of policy.kwargs.critic.'
    >>> retired_line("policy.kwargs", ["critic", "std"], "policy/my_mlp")
    'config error: policy.kwargs is gone: its entries are fields of policy now; in policy/my_mlp, move them up one level: policy.critic, policy.std.'
    >>> retired_line("policy.critic") is None
    True
    >>> rename("rollout.pipeline_stages", "staging.pipeline_stages")
    >>> retired_line("rollout.pipeline_stages")
    'config error: rollout.pipeline_stages is staging.pipeline_stages now; write staging.pipeline_stages instead.'
    """
    for old, new in _RENAMED.items():
        if key == old or key.startswith(old + "."):
            return f"config error: {old} is {new} now; write {new}{key[len(old):]} instead."
    for old, parent in _RETIRED.items():
        if key == old or key.startswith(old + "."):
            rest = key[len(old) + 1:]
            if rest:
                fix = f"write {parent}.{rest} instead of {key}"
            else:
                moved = ", ".join(f"{parent}.{e}" for e in entries) or f"{parent}.<entry>"
                fix = f"{f'in {where}, ' if where else ''}move them up one level: {moved}"
            return f"config error: {old} is gone: its entries are fields of {parent} now; {fix}."
    return None


def _remember(cls) -> None:
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)) or cls.__name__ in _DATACLASSES:
        return
    _DATACLASSES[cls.__name__] = cls
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an unresolvable hint only costs a field list in a message
        return
    for hint in hints.values():
        for t in (hint, *typing.get_args(hint)):
            _remember(t)
