"""The policy registry: names -> ``"module:Class"`` or classes, imported on lookup.

Classes are called as ``cls(cfg, env_spec, device=device)`` when their ``__init__`` takes a
``device`` (they build their weights there, in the dtype that device wants), else as
``cls(cfg, env_spec)`` and then moved (third-party policies written before); ``cfg`` is an
instance of the class's ``config_class`` (``policy_config(name, **fields)`` makes one), whose
schema is stored as ``policy/<name>_schema`` (:func:`register_schemas`). Same rules as the
env registry: a decorator ``@register_policy("name")``, ``override=True`` to replace, and
entry points in group ``m2flow.policies``.
"""

from __future__ import annotations

import inspect

from m2flow.policies.base import Policy, PolicyError
from m2flow.policies.config import PolicyConfig
from m2flow.registry import Registry

ENTRY_POINT_GROUP = "m2flow.policies"

POLICIES = Registry(
    "policy",
    ENTRY_POINT_GROUP,
    PolicyError,
    base_config=PolicyConfig,
    builtins={
        "mlp": "m2flow.policies.mlp:GaussianMLPPolicy",
        "cnn": "m2flow.policies.cnn:GaussianCNNPolicy",
        "openvla": "m2flow.policies.vla.openvla:OpenVLAPolicy",
        "openvla_oft": "m2flow.policies.vla.oft:OpenVLAOFTPolicy",
        "sac_mlp": "m2flow.policies.sac:SACPolicy",
        "sac_cnn": "m2flow.policies.sac:SACCNNPolicy",
        "flow_mlp": "m2flow.policies.flow:FlowMLPPolicy",
        "pi0": "m2flow.policies.vla.pi0:Pi0Policy",
    },
)

register_policy, registered_policies, policy_class, policy_config = POLICIES.functions()


def make_policy(cfg: PolicyConfig, env_spec, device: str = "cpu") -> Policy:
    """Builds policy ``cfg.name`` for an env with ``env_spec``, on ``device``; PolicyError
    when ``cfg`` is not the policy's settings class or its libraries are not installed."""
    cls = POLICIES.require(cfg.name)
    POLICIES.check_settings(cfg, cls, "policy")
    if takes_device(cls):
        return cls(cfg, env_spec, device=device)
    return cls(cfg, env_spec).to(device)


def register_schemas(cs) -> None:
    """Stores each policy's ``config_class`` in ConfigStore ``cs`` as ``policy/<name>_schema``,
    so a policy group file that starts with ``defaults: [<name>_schema, _self_]`` is checked
    against it. Imports every policy module (not its checkpoints)."""
    POLICIES.store_schemas(cs, "policy")


def takes_device(cls) -> bool:
    """Whether ``cls(cfg, env_spec, device=...)`` is a valid call: a policy that builds itself
    on its device (m2flow's VLAs, whose constructors load pretrained files straight onto it)."""
    return "device" in inspect.signature(cls.__init__).parameters
