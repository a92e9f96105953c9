"""Schemas in Hydra's ConfigStore, so every YAML and override is type-checked.

The schemas come from the layers that own them (a workload's root config, an algorithm's
config); this module only stores them and remembers every dataclass reachable from them, so
that an error message can list the fields of the class at fault. It imports no workload.

Defaults live only in the dataclasses; YAML files set what differs from them.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Optional

from hydra.core.config_store import ConfigStore

_DATACLASSES: dict[str, type] = {}


def store(name: str, node: type, group: Optional[str] = None) -> None:
    """Stores dataclass ``node`` as schema ``name`` (in config group ``group``)."""
    ConfigStore.instance().store(name=name, node=node, group=group)
    _remember(node)


def dataclass_named(name: str) -> Optional[type]:
    """The stored (or nested) config dataclass called ``name``, if any."""
    return _DATACLASSES.get(name)


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
