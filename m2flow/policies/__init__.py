"""Models behind one interface (act / evaluate_actions / value), found through a registry."""

from m2flow.policies.base import Policy, PolicyError
from m2flow.policies.config import PolicyConfig
from m2flow.policies.registry import (
    make_policy, policy_config, register_policy, registered_policies)

__all__ = [
    "Policy",
    "PolicyConfig",
    "PolicyError",
    "make_policy",
    "policy_config",
    "register_policy",
    "registered_policies",
]
