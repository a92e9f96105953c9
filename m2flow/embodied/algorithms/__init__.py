"""Embodied algorithms behind one interface (:class:`Algorithm`), found through a registry.

Names map to ``"module:Class"`` strings imported on lookup; installed packages add names
through the entry-point group ``m2flow.algorithms``; ``register_algorithm(name, cls)`` (or as a
decorator) adds one in code, ``override=True`` to replace. A new algorithm is one module (its
config dataclass, ``prepare`` and ``loss``) and one ``configs/algorithm/<name>.yaml``.

>>> algorithm_class("ppo").__name__, algorithm_class("ppo").config_class.__name__
('PPO', 'PPOConfig')
>>> try:
...     algorithm_class("pp0")
... except AlgorithmError as e:
...     print(e)
Unknown algorithm 'pp0'. Known: bc, grpo, ppo. Did you mean 'ppo'?
"""

from __future__ import annotations

from m2flow.embodied.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmError
from m2flow.registry import Registry

ENTRY_POINT_GROUP = "m2flow.algorithms"

ALGORITHMS = Registry(
    "algorithm",
    ENTRY_POINT_GROUP,
    AlgorithmError,
    {
        "ppo": "m2flow.embodied.algorithms.ppo:PPO",
        "grpo": "m2flow.embodied.algorithms.grpo:GRPO",
        "bc": "m2flow.embodied.algorithms.bc:BC",
    },
)

register_algorithm = ALGORITHMS.register
registered_algorithms = ALGORITHMS.names
algorithm_class = ALGORITHMS.load


def register_schemas(cs) -> None:
    """Stores each registered algorithm's config dataclass in Hydra's ConfigStore as
    ``algorithm/<name>_schema``; ``configs/algorithm/<name>.yaml`` extends it with
    ``defaults: [<name>_schema, _self_]``, so ``algorithm=<name>`` is checked against it."""
    for name in registered_algorithms():
        try:
            cls = algorithm_class(name)
        except AlgorithmError:  # a plugin that does not import: fails when it is chosen
            continue
        cs.store(group="algorithm", name=f"{name}_schema", node=cls.config_class)


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmConfig",
    "AlgorithmError",
    "algorithm_class",
    "register_algorithm",
    "register_schemas",
    "registered_algorithms",
]
