"""Embodied algorithms behind one interface (:class:`Algorithm`), found through a registry.

Names map to ``"module:Class"`` strings imported on lookup; installed packages add names
through the entry-point group ``m2flow.algorithms``; ``register_algorithm(name, cls)`` (or as a
decorator) adds one in code, ``override=True`` to replace. A new algorithm is one module (its
config dataclass, and its class with ``prepare`` and ``train``, its own update loop), its
``"module:Class"`` line in :data:`BUILTINS` and one ``configs/algorithm/<name>.yaml``. The modules beside the algorithms
are the interface (:mod:`.base`) and the pieces they share (:mod:`.helpers`); a module is an
algorithm only by its line in :data:`BUILTINS`. Its config's ``validate`` checks its fields with
:func:`check_field`, and what the learner worker needs of it besides (parameter groups, the
step size's schedule, checkpointed state) it says through :class:`Algorithm`'s hooks.

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
    Algorithm, AlgorithmConfig, AlgorithmError, check_field, loss_metrics)
from m2flow.registry import Registry

ENTRY_POINT_GROUP = "m2flow.algorithms"

BUILTINS = {
    "ppo": "m2flow.embodied.algorithms.ppo:PPO",
    "grpo": "m2flow.embodied.algorithms.grpo:GRPO",
    "bc": "m2flow.embodied.algorithms.bc:BC",
    "sac": "m2flow.embodied.algorithms.sac:SAC",
}
"""The algorithms m2flow ships: name -> ``"module:class"``, imported when the name is looked
up. Plugins add theirs through the entry-point group, not here."""


ALGORITHMS = Registry("algorithm", ENTRY_POINT_GROUP, AlgorithmError, BUILTINS)

register_algorithm, registered_algorithms, algorithm_class, algorithm_config = (
    ALGORITHMS.functions())


def register_schemas(cs) -> None:
    """Stores each registered algorithm's config dataclass in Hydra's ConfigStore as
    ``algorithm/<name>_schema``; ``configs/algorithm/<name>.yaml`` extends it with
    ``defaults: [<name>_schema, _self_]``, so ``algorithm=<name>`` is checked against it."""
    ALGORITHMS.store_schemas(cs, "algorithm")  # a plugin that does not import: skipped


__all__ = [
    "ALGORITHMS",
    "BUILTINS",
    "Algorithm",
    "AlgorithmConfig",
    "AlgorithmError",
    "algorithm_class",
    "algorithm_config",
    "check_field",
    "loss_metrics",
    "register_algorithm",
    "register_schemas",
    "registered_algorithms",
]
