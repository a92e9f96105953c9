"""Processes that see the simulator and model stacks (m2flow's extras) as not installed.

``without_stacks(folder)`` writes a ``sitecustomize.py`` into ``folder`` and returns an
environment whose ``PYTHONPATH`` starts there. Python runs that file at start-up, in the process
and in every Python process it starts with that environment (Ray's workers, simulator
processes); it wraps each finder of ``sys.meta_path`` so that the stacks' top-level modules are
not found: ``import mani_skill`` raises ModuleNotFoundError and
``importlib.util.find_spec("mani_skill")`` is None, as on a machine where ``pip install m2flow``
installed no extra. (A finder that raised instead would also break the libraries that only ask
whether a package is there, as tensordict does for h5py at import.)
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

STACKS = (
    "mani_skill", "sapien", "fast_simplification", "h5py", "mplib", "toppra",  # [maniskill]
    "libero", "robosuite", "mujoco",  # [libero]
    "mjlab", "mujoco_warp", "warp",  # [mjlab]
    "metaworld",  # [metaworld]
    "timm", "peft",  # [vla] (transformers stays: the reasoning workload uses it)
)

SITECUSTOMIZE = '''\
"""Written by tests/stacks.py: {names} are not found in this process."""
import sys

_HIDDEN = frozenset({names!r})


class _Hide:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _HIDDEN:
            return None
        find = getattr(self.finder, "find_spec", None)
        return None if find is None else find(name, path, target)

    def __getattr__(self, attr):  # invalidate_caches, find_distributions, ...
        return getattr(self.finder, attr)


sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
'''


def without_stacks(folder: Path, names: tuple[str, ...] = STACKS) -> dict[str, str]:
    """The environment of a process (and its children) in which ``names`` look uninstalled;
    the repository root is on its path, so the m2flow it imports is this one."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(names=sorted(names)))
    paths = [str(folder), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p),
                RAY_USAGE_STATS_ENABLED="0")
