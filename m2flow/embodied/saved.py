"""A checkpoint's saved config written by an older m2flow, in this version's layout, so
``m2flow-eval checkpoint=`` reads every checkpoint.

Before each env and policy had a settings class of its own, their options sat under
``env.kwargs`` and ``policy.kwargs``, and one flat ``EnvConfig`` held every adapter's
settings (``visual_mesh_fraction``, ``step_timeout_s``, ...). :func:`upgrade` moves each
``kwargs`` entry up a level (into ``make_args`` where the adapter has that and lacks the key:
those adapters passed ``kwargs`` on to ``gym.make``), and drops an old field that the settings
class of the saved name lacks when it holds its old default. Any other value stays, so the
merge onto the settings class names it as a field that does not exist.

>>> old = {"env": {"name": "gym/Pendulum-v1", "visual_mesh_fraction": 1.0,
...                "kwargs": {"g": 9.81}},
...        "policy": {"name": "mlp", "hidden_sizes": [64], "kwargs": {"critic": "shared"}}}
>>> new = upgrade(old)
>>> new["env"]
{'name': 'gym/Pendulum-v1', 'make_args': {'g': 9.81}}
>>> new["policy"]
{'name': 'mlp', 'hidden_sizes': [64], 'critic': 'shared'}
"""

from __future__ import annotations

import dataclasses
from typing import Optional

OLD_DEFAULTS = {  # the fields of the old flat EnvConfig and PolicyConfig that not every
    # settings class has, with their old defaults
    "env": {"render_backend": "auto", "visual_mesh_fraction": 1.0, "privileged_state": False,
            "step_timeout_s": 300.0, "shared_memory": "auto"},
    "policy": {"hidden_sizes": [256, 256, 256], "activation": "tanh", "normalize_obs": True,
               "init_log_std": -0.5},
}
PASSED_ON = "make_args"  # the settings field of adapters whose old kwargs went to gym.make


def upgrade(saved: dict) -> dict:
    """``saved`` (a plain dict) with its ``env`` and ``policy`` in this version's layout."""
    out = dict(saved)
    for group in OLD_DEFAULTS:
        if isinstance(out.get(group), dict):
            out[group] = _upgrade_group(group, dict(out[group]))
    return out


def _upgrade_group(group: str, node: dict) -> dict:
    known = _fields(group, node.get("name"))
    for key, value in (node.pop("kwargs", None) or {}).items():
        if known is not None and key not in known and PASSED_ON in known:
            node[PASSED_ON] = {**node.get(PASSED_ON, {}), key: value}
        else:
            node[key] = value
    for key, default in OLD_DEFAULTS[group].items():
        if known is not None and key not in known and node.get(key, default) == default:
            node.pop(key, None)
    return node


def _fields(group: str, name: Optional[str]) -> Optional[set]:
    """The fields of ``name``'s settings class; None when the name is not registered here
    (the merge then reports it)."""
    from m2flow.envs.registry import ENVS
    from m2flow.policies.registry import POLICIES

    registry = {"env": ENVS, "policy": POLICIES}[group]
    if not isinstance(name, str):
        return None
    try:
        cls = registry.config_class(registry.load(name))
    except registry.error:
        return None
    return {f.name for f in dataclasses.fields(cls)}
