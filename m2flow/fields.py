"""The range of one settings field, checked by the class that owns it: each typed settings
class's ``validate()`` calls :func:`check_bound` for each of its fields, in order, and the
first one out of its :class:`Bound` is one line naming the field, the value and the fix
(a :class:`FieldError`). Shared by every layer, so it imports no m2flow module.

>>> from types import SimpleNamespace as NS
>>> check_bound(NS(num_iterations=-1), "runner.num_iterations", at_least(1),
...             "set it to the number of iterations to run")
Traceback (most recent call last):
...
m2flow.fields.FieldError: config error: runner.num_iterations=-1: must be >= 1; set it to the number of iterations to run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable


class FieldError(ValueError):
    """A config field out of its range, or a path that is not what it should be; the message
    is the whole ``config error: field=value: ...`` line."""


@dataclass(frozen=True)
class Bound:
    """What a field's value must satisfy, and how a message says it."""

    ok: Callable[[Any], bool]
    says: str


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def at_least(low: float) -> Bound:
    return Bound(lambda v: _number(v) and v >= low, f"must be >= {low}")


def above(low: float) -> Bound:
    return Bound(lambda v: _number(v) and v > low, f"must be > {low}")


def within(low: float, high: float, *, open_low: bool = False) -> Bound:
    """``[low, high]``, or ``(low, high]`` with ``open_low``."""
    left = "(" if open_low else "["
    return Bound(lambda v: _number(v) and (v > low if open_low else v >= low) and v <= high,
                 f"must be in {left}{low}, {high}]")


def one_of(options: Iterable[Any]) -> Bound:
    options = tuple(options)
    return Bound(lambda v: v in options, f"must be one of {', '.join(map(str, options))}")


def optional(bound: Bound, null_means: str) -> Bound:
    """``bound``, or None (which means ``null_means``)."""
    return Bound(lambda v: v is None or bound.ok(v), f"{bound.says}, or null ({null_means})")


def check_bound(cfg: Any, name: str, bound: Bound, fix: str) -> None:
    """Raises FieldError ``config error: <name>=<value>: <bound>; <fix>.`` unless the field of
    ``cfg`` that ``name`` ends in (``runner.num_iterations``: ``cfg.num_iterations``) is
    within ``bound``; ``name`` is where the field sits in the root config."""
    value = getattr(cfg, name.rsplit(".", 1)[-1])
    if not bound.ok(value):
        raise field_error(name, value, f"{bound.says}; {fix}.")


def field_error(name: str, value: Any, text: str) -> FieldError:
    """``config error: <name>=<value>: <text>``, a number shown as it is, anything else as
    its repr."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    shown = value if number else repr(value)
    return FieldError(f"config error: {name}={shown}: {text}")
