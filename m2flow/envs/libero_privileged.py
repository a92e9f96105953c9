"""LIBERO's privileged vector: its fixed layout per task, for critics, the scripted expert
and state policies (``env.privileged_state=true``; :mod:`m2flow.envs.libero` fills it).

The layout: end-effector position (3) and quaternion (4, x y z w), gripper finger positions
(2), then one slot of position (3) and quaternion (4) per movable object: slot 0 the object the
task moves, slot 1 its target (the BDDL's ``obj_of_interest``), then the others in the BDDL's
order; zeros in the slots a task does not fill.
"""

from __future__ import annotations

from typing import Sequence

PRIVILEGED_ROBOT = (("eef_pos", 3), ("eef_quat", 4), ("gripper_qpos", 2))
"""The privileged vector's first entries: (name, width), read from robosuite's
``robot0_<name>`` observations."""
OBJECT_FIELDS = (("pos", 3), ("quat", 4))
"""Each object slot of the privileged vector: robosuite's ``<object>_<field>`` observations."""


def task_objects(bddl: str) -> tuple:
    """The movable objects of a task in the privileged vector's slot order: the object it
    moves, its target (the BDDL's ``obj_of_interest``), then the rest in the BDDL's order."""
    from libero.libero.envs.bddl_utils import robosuite_parse_problem

    problem = robosuite_parse_problem(bddl)
    interest = list(problem["obj_of_interest"])
    rest = [o for names in problem["objects"].values() for o in names if o not in interest]
    return tuple(interest + rest)


def privileged_layout(objects: Sequence[str], slots: int) -> list:
    """(name, slice) of each part of the privileged vector of a task with ``objects`` (in
    slot order) in a vector of ``slots`` object slots; empty slots are named ``slot<j>_*``.

    >>> [(n, s.start, s.stop) for n, s in privileged_layout(["soup_1", "basket_1"], 3)][2:6]
    [('gripper_qpos', 7, 9), ('soup_1_pos', 9, 12), ('soup_1_quat', 12, 16), ('basket_1_pos', 16, 19)]
    >>> privileged_layout(["soup_1"], 2)[-1]
    ('slot1_quat', slice(19, 23, None))
    """
    out, at = [], 0
    parts = list(PRIVILEGED_ROBOT) + [
        (f"{objects[j] if j < len(objects) else f'slot{j}'}_{field}", width)
        for j in range(slots) for field, width in OBJECT_FIELDS]
    for name, width in parts:
        out.append((name, slice(at, at + width)))
        at += width
    return out


def privileged_dim(slots: int) -> int:
    """The width of the privileged vector with ``slots`` object slots."""
    return sum(w for _, w in PRIVILEGED_ROBOT) + slots * sum(w for _, w in OBJECT_FIELDS)
