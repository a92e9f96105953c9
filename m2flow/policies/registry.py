"""The policy registry: names -> ``"module:Class"`` or classes, imported on lookup.

Classes are called as ``cls(cfg, env_spec)``. Same rules as the env registry: a decorator
``@register_policy("name")``, ``override=True`` to replace, and entry points in group
``m2flow.policies``.
"""

from __future__ import annotations

from m2flow.policies.base import Policy, PolicyError
from m2flow.policies.config import PolicyConfig
from m2flow.registry import Registry

ENTRY_POINT_GROUP = "m2flow.policies"

POLICIES = Registry(
    "policy",
    ENTRY_POINT_GROUP,
    PolicyError,
    {
        "mlp": "m2flow.policies.mlp:GaussianMLPPolicy",
        "cnn": "m2flow.policies.cnn:GaussianCNNPolicy",
        "openvla": "m2flow.policies.vla.openvla:OpenVLAPolicy",
        "openvla_oft": "m2flow.policies.vla.oft:OpenVLAOFTPolicy",
    },
)

register_policy = POLICIES.register
registered_policies = POLICIES.names
policy_class = POLICIES.load


def make_policy(cfg: PolicyConfig, env_spec) -> Policy:
    """Builds policy ``cfg.name`` for an env with ``env_spec``."""
    return policy_class(cfg.name)(cfg, env_spec)
