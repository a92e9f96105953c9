"""Embodied algorithms behind one interface (:class:`Algorithm`), found through a registry.

Names map to ``"module:Class"`` strings imported on lookup; installed packages add names
through the entry-point group ``m2flow.algorithms``; ``register_algorithm(name, cls)`` (or as a
decorator) adds one in code, ``override=True`` to replace. A new algorithm is one module (its
config dataclass, ``prepare`` and ``loss``, and ``ALGORITHM = <its class>``) and one
``configs/algorithm/<name>.yaml``; its config's ``validate`` checks its fields with
:func:`check_field`, and what it changes in the learner's loop (parameter groups, the step
size's schedule, parameters frozen for an update) it says through :class:`Algorithm`'s hooks.

>>> algorithm_class("ppo").__name__, algorithm_class("ppo").config_class.__name__
('PPO', 'PPOConfig')
>>> try:
...     algorithm_class("pp0")
... except AlgorithmError as e:
...     print(e)
Unknown algorithm 'pp0'. Known: bc, grpo, ppo, sac. Did you mean 'ppo'?
"""

from __future__ import annotations

from m2flow.embodied.algorithms.base import (
    Algorithm, AlgorithmConfig, AlgorithmError, check_field)
from m2flow.registry import Registry

ENTRY_POINT_GROUP = "m2flow.algorithms"

HELPER_MODULES = frozenset({"base", "losses", "advantages", "offpolicy", "demo_term"})  # shared pieces, not algorithms


def _builtin_algorithms() -> dict[str, str]:
    """Every other module of this package is an algorithm named after the module, its class
    the module's ``ALGORITHM``: adding one is adding a module (and its config file). Nothing
    is imported here; the registry imports a module when its name is looked up."""
    import pkgutil

    return {m.name: f"{__name__}.{m.name}:ALGORITHM" for m in pkgutil.iter_modules(__path__)
            if m.name not in HELPER_MODULES and not m.name.startswith("_")}


ALGORITHMS = Registry("algorithm", ENTRY_POINT_GROUP, AlgorithmError, _builtin_algorithms())

register_algorithm = ALGORITHMS.register
registered_algorithms = ALGORITHMS.names
algorithm_class = ALGORITHMS.load


def register_schemas(cs) -> None:
    """Stores each registered algorithm's config dataclass in Hydra's ConfigStore as
    ``algorithm/<name>_schema``; ``configs/algorithm/<name>.yaml`` extends it with
    ``defaults: [<name>_schema, _self_]``, so ``algorithm=<name>`` is checked against it."""
    ALGORITHMS.store_schemas(cs, "algorithm")  # a plugin that does not import: skipped


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmConfig",
    "AlgorithmError",
    "algorithm_class",
    "check_field",
    "register_algorithm",
    "register_schemas",
    "registered_algorithms",
]
