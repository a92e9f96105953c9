"""Start-up checks every workload's config shares: ranges of numeric fields (as tables of
rules), paths that must exist, the ``runner`` base group, the cluster and its placement on
the machines it will have, and the checkpoint to resume from. Each failure is one line naming
the field, the value and the fix; nothing here starts a worker, Ray or a simulator.

>>> from types import SimpleNamespace as NS
>>> check_fields(NS(runner=NS(num_iterations=-1)), [
...     ("runner.num_iterations", at_least(1), "set it to the number of iterations to run")])
Traceback (most recent call last):
...
m2flow.runs.checks.FieldError: config error: runner.num_iterations=-1: must be >= 1; set it to the number of iterations to run.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from m2flow.pipelines import Placement, PlacementError
from m2flow.pipelines.cluster import check_cluster, expected_nodes
from m2flow.pipelines.placement import check_placement


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


def each(bound: Bound) -> Bound:
    """Every item of a list satisfies ``bound``."""
    return Bound(lambda v: all(bound.ok(x) for x in v), f"every entry {bound.says}")


Rule = tuple[str, Bound, str]
"""(dotted field, its bound, the fix)."""


def check_fields(cfg: Any, rules: Iterable[Rule]) -> None:
    """Raises FieldError for the first rule whose field (a dotted path in ``cfg``) is out of
    its bound: ``config error: <field>=<value>: <bound>; <fix>.``"""
    for name, bound, fix in rules:
        value = lookup(cfg, name)
        if not bound.ok(value):
            raise field_error(name, value, f"{bound.says}; {fix}.")


def lookup(cfg: Any, name: str) -> Any:
    for part in name.split("."):
        cfg = getattr(cfg, part)
    return cfg


def field_error(name: str, value: Any, text: str) -> FieldError:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    shown = value if number else repr(value)
    return FieldError(f"config error: {name}={shown}: {text}")


def check_file(name: str, path: Optional[str], fix: str) -> None:
    """``path`` (field ``name``) is None or an existing file."""
    if path is not None and not Path(path).expanduser().is_file():
        is_dir = Path(path).expanduser().is_dir()
        what = "is a directory, not a file" if is_dir else "does not exist"
        raise field_error(name, path, f"{what}; {fix}.")


RUNNER_BASE_RULES: list[Rule] = [
    ("runner.checkpoint_interval", at_least(0), "save every N iterations, or 0 for only the last"),
    ("runner.max_minutes", optional(above(0), "the iteration count decides"),
     "give the loop's wall-time budget in minutes, or null"),
    ("runner.keep_checkpoints", at_least(0),
     "keep the newest N checkpoints (and the best), or 0 for all"),
    ("runner.progress_interval_s", at_least(0),
     "give the seconds between progress lines of a long phase (0: every round)"),
    ("runner.channel_timeout_s", above(0), "give the seconds a worker may be silent (default 600)"),
    ("runner.stall_timeout_s", optional(above(0), "limits from each phase's measured durations"),
     "give the seconds a worker may make no progress, or null"),
]


def check_runner_base(cfg: Any) -> None:
    """The fields of every workload's ``runner`` group (``RunnerBaseConfig``) and ``seed``."""
    check_fields(cfg, RUNNER_BASE_RULES + [("seed", at_least(0), "use a non-negative seed")])
    log_dir = Path(cfg.runner.log_dir).expanduser()
    if log_dir.exists() and not log_dir.is_dir():
        raise field_error("runner.log_dir", cfg.runner.log_dir,
                          "is a file; runs are written into a folder, point it at one.")


def check_cluster_config(cluster: Any, components: Sequence[str],
                         unused: Sequence[str] = ()) -> Optional[Placement]:
    """The ``cluster`` group against the machines it will have, before Ray starts: the
    backend, and the placement of ``components`` (the workload's; the config may list fewer)
    on this machine's cores and GPUs; ``unused``: names the config may list that this
    workload ignores (a cluster group shared with another workload places them). Returns the
    placement; None when joining a Ray cluster (its nodes are known once connected; the
    node-independent rules are checked)."""
    known = tuple(components) + tuple(unused)
    try:
        check_cluster(cluster)
        nodes = expected_nodes(cluster)
        if nodes is None:
            check_placement(cluster.placement, known)
            return None
        placement = Placement(cluster.placement, nodes, known)
        for name in components:  # the unlisted ones get defaults: those must fit too
            placement.ranks(name)
        return placement
    except PlacementError as e:  # its fields are the cluster group's
        text = re.sub(r"(?<![\w.])placement\.", "cluster.placement.", str(e))
        raise FieldError(f"config error: {text}") from None
    except ValueError as e:
        raise FieldError(f"config error: {e}") from None


def check_resume(path: Optional[str], workload: str, name: str = "resume") -> Optional[dict]:
    """``path`` is None or an m2flow checkpoint of ``workload`` (read mapped, not loaded);
    returns its state, mapped (None for no path), for further checks without a second read."""
    if path is None:
        return None
    from m2flow.runs import checkpoint

    try:
        return checkpoint.load(path, workload=workload, mmap=True)
    except ValueError as e:
        good = checkpoint.newest_good(path, workload)
        other = f" The newest good checkpoint beside it: {good}." if good else ""
        raise FieldError(
            f"config error: {name}={path}: {str(e).splitlines()[0]}{other}") from None
