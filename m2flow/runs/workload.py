"""What a workload tells the command line: its config schema, its start-up checks, and how it
trains and evaluates. ``m2flow/cli/workloads.py`` holds the one table of workloads; nothing
else knows more than one of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Workload:
    """One workload (``embodied``, ``reasoning``) as the CLI sees it.

    A root config names its workload in its ``workload`` field; the entry config's defaults
    name the schema (``- train_schema``).
    """

    name: str
    """The value of the root config's ``workload`` field and of a checkpoint's tag."""
    schema: str
    """Name of the root schema in Hydra's ConfigStore (``train_schema``)."""
    config_class: type
    """The root config dataclass."""
    register_schemas: Callable[[Any], None]
    """Stores the root schema and the schemas of its config groups in a ``ConfigStore``."""
    check: Callable[[Any], None]
    """Start-up checks of a config object: every range and cross-field rule, registry names,
    paths; raises ``ValueError`` with one line naming the field, the value and the fix.
    Starts no worker and no simulator."""
    train: Callable[[Any, Optional[Any]], int]
    """``train(cfg, control)``: runs training under ``control`` (the command's
    ``runs.control.RunControl``; None: the run's own); returns the exit code."""
    evaluate: Callable[[Any, Optional[dict], Optional[Any]], int]
    """``evaluate(cfg, state, control)``: runs ``m2flow-eval`` with a config and a checkpoint's
    state (None: initial weights), under ``control`` as ``train``."""
    eval_shorthands: dict[str, str] = field(default_factory=dict)
    """``m2flow-eval`` arguments that stand for a config key (``episodes`` -> ``eval.episodes``)."""
    memory_hint: Optional[Callable[[Any], str]] = None
    """The fields that size a run's memory, with their values (``lower env.num_envs (now 64)
    ...``): the fix of the one line a run killed for memory ends with. None: no hint."""
    typed_base: Optional[Callable[[Any], Any]] = None
    """The typed config a saved config (a checkpoint's, as a DictConfig) is merged onto; for
    config groups whose schema depends on a saved value (embodied: the algorithm's, the env's
    and the policy's config classes, from their ``name``). None: the root schema's defaults."""
