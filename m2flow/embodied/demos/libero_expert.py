"""A scripted LIBERO pick-and-place expert: waypoints from the privileged state
(``env.privileged_state=true``, :func:`m2flow.envs.libero_privileged.privileged_layout`), tracked with
robosuite's OSC_POSE controller.

One template covers LIBERO-Object ("pick up the <item> and place it in the basket") and
LIBERO-Spatial ("pick up the black bowl <where> and place it on the plate"): above the object,
down, grasp, lift, over the target, down, release. The object the task moves is slot 0 of
the privileged vector, its target slot 1; how to hold each is a per-class :class:`Grasp` and
:class:`Place` (an object's class is its BDDL name without the instance number:
``akita_black_bowl_1`` -> ``akita_black_bowl``):

- a can, bottle or carton is grasped from the top at its centre, the fingers across it;
- a flat box (cream cheese, butter, pudding) likewise, the gripper turned to the box's yaw
  so the fingers close across its short side (robosuite's Panda closes along its hand's y
  axis, which points along world -y when the hand points down at yaw 0);
- a bowl (wider than the gripper opens) by its rim: the fingers close across the rim's wall,
  the hand offset from the bowl's centre by the rim's radius along the closing axis.

Actions are OSC_POSE's: a position delta in [-1, 1] scaled by the controller's
``output_max`` (:data:`POS_SCALE` m per step), an axis-angle rotation delta scaled by
:data:`ROT_SCALE` rad, both in the world frame (robosuite's ``set_goal_orientation``
pre-multiplies the current orientation), and the gripper, -1 open, +1 closed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

POS_SCALE = 0.05  # robosuite 1.4.0 osc_pose.json output_max, m per action unit
ROT_SCALE = 0.5  # rad per action unit (same file)
OPEN, CLOSE = -1.0, 1.0  # LIBERO's gripper convention
POS_GAIN = 1.0  # the step's goal offset as a fraction of the error (1: the waypoint itself)
ROT_GAIN = 1.0  # the same for the orientation
REACHED = 0.01  # m: a waypoint is reached within this distance
REACHED_ROT = 0.1  # rad
GRIPPER_STEPS = 12  # control steps of closing or opening in place (the fingers take ~10)
WAYPOINT_STEPS = 60  # a waypoint not reached in this many steps is left (blocked by contact)
CLEARANCE = 0.10  # m above the grasp height where the hand approaches and leaves
CARRY = 0.08  # m between the carried object's bottom and the target's top while moving
FINGER_REACH = 0.05  # m from the grasp point to the open outer finger's outer face
RIM_CLEAR = 0.08  # m from that face to another object's centre (a ramekin's radius ~0.04)
RIM_LEVEL = 0.03  # m: objects whose position is within this height of the bowl's stand by it
RIM_TURN = np.pi / 12  # rad: the steps rim_side turns the grasped side by


@dataclass(frozen=True)
class Grasp:
    """How the expert holds one class of object (offsets from its pose, in metres)."""

    dz: float = 0.0
    """Grasp height above the object's position (its centre for LIBERO-Object's items, its
    bottom for a bowl)."""
    below: float = 0.05
    """How far the object reaches below the grasp point (to lift it clear of the target)."""
    rim: float = 0.0
    """> 0: grasp the rim at this distance from the centre along the fingers' closing axis."""
    align_yaw: bool = False
    """Turn the hand to the object's yaw (a box: fingers across its short side)."""


@dataclass(frozen=True)
class Place:
    """Where the expert lets go over one class of target."""

    top: float
    """Height of the target's top above its position (m)."""
    release: float
    """Gap between the carried object's bottom and the target's top when it lets go (m)."""


GRASPS = {
    # LIBERO-Object: items on the floor; position = the item's centre
    "alphabet_soup": Grasp(dz=0.01, below=0.05),
    "tomato_sauce": Grasp(dz=0.01, below=0.05),
    "cream_cheese": Grasp(dz=0.0, below=0.01, align_yaw=True),
    "butter": Grasp(dz=0.0, below=0.01, align_yaw=True),
    "chocolate_pudding": Grasp(dz=0.0, below=0.015, align_yaw=True),
    "salad_dressing": Grasp(dz=0.03, below=0.10),
    "bbq_sauce": Grasp(dz=0.02, below=0.08),
    "ketchup": Grasp(dz=0.03, below=0.10),
    "milk": Grasp(dz=0.03, below=0.10),
    "orange_juice": Grasp(dz=0.03, below=0.10),
    # LIBERO-Spatial: the bowl's position is its bottom; rim radius ~0.053 m, height ~0.05 m
    "akita_black_bowl": Grasp(dz=0.035, below=0.035, rim=0.045),
}
PLACES = {
    "basket": Place(top=0.10, release=0.03),  # wall top ~0.10 m (the handle rises to 0.14)
    "plate": Place(top=0.02, release=0.01),
}


def object_class(name: str) -> str:
    """``akita_black_bowl_1`` -> ``akita_black_bowl``."""
    base, _, num = name.rpartition("_")
    return base if num.isdigit() else name


@dataclass(frozen=True)
class Waypoint:
    """A hand pose to reach (world position, yaw about the vertical) and the gripper there."""

    pos: np.ndarray
    yaw: float
    gripper: float
    hold: int = 0
    """> 0: stay here this many steps (closing or opening the gripper)."""


def quat_to_mat(q: Sequence[float]) -> np.ndarray:
    """(x, y, z, w) quaternion -> 3x3 rotation matrix (robosuite's order)."""
    x, y, z, w = np.asarray(q, dtype=np.float64) / np.linalg.norm(q)
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
    ])


def yaw_of(q: Sequence[float]) -> float:
    """The yaw of an object's local x axis in the world, in [-pi/2, pi/2) (a box is the same
    turned by pi)."""
    ax = quat_to_mat(q)[:, 0]
    yaw = float(np.arctan2(ax[1], ax[0]))
    return (yaw + np.pi / 2) % np.pi - np.pi / 2


def hand_down(yaw: float) -> np.ndarray:
    """The hand's orientation pointing down, turned by ``yaw`` about the vertical: Rz(yaw) Rx(pi)."""
    c, s = np.cos(yaw), np.sin(yaw)
    return np.array([[c, s, 0.0], [s, -c, 0.0], [0.0, 0.0, -1.0]])


def closing_yaw(axis: Sequence[float]) -> float:
    """The hand's yaw whose fingers close along the horizontal ``axis`` (either way: the two
    fingers are alike), in [-pi/2, pi/2): the Panda's last joint turns the hand within
    +-2.9 rad of its yaw 0 at ~0.8, so a yaw near pi leaves it at its limit, which stalls the
    arm (the hand's yaw is ~0.8 - q7).

    >>> round(closing_yaw([0.0, -1.0]), 6), round(closing_yaw([0.0, 1.0]), 6)
    (0.0, 0.0)
    >>> round(closing_yaw([1.0, 1.0]), 6)  # 3 pi/4 - pi: the same axis turned by pi
    -0.785398
    """
    yaw = float(np.arctan2(axis[0], -axis[1]))  # hand_down(yaw)[:, 1] = (sin, -cos, 0)
    return (yaw + np.pi / 2) % np.pi - np.pi / 2


def rim_side(parts: dict, moved: str, target: str, start: Optional[np.ndarray]) -> np.ndarray:
    """The horizontal unit vector from a bowl's centre to the rim point the fingers grasp:
    between the sides facing the hand's start (where the arm comes from, so no fixture stands
    there) and the target (a cabinet's drawer is open towards the table, and the bowl leaves
    that way), turned by :data:`RIM_TURN` steps, the least first, until the outer finger
    clears every other object standing on the bowl's level by :data:`RIM_CLEAR` (a ramekin
    next to it). None: world -y (the closing axis at yaw 0)."""
    pos = np.asarray(parts[f"{moved}_pos"], dtype=np.float64)
    if start is None:
        return np.array([0.0, -1.0, 0.0])
    unit = lambda v: v / max(np.linalg.norm(v), 1e-9)
    prefer = unit(np.asarray(start[:2], dtype=np.float64) - pos[:2])
    goal = np.asarray(parts[f"{target}_pos"][:2], dtype=np.float64)
    if np.linalg.norm(goal - pos[:2]) > 1e-6:
        prefer = unit(prefer + unit(goal - pos[:2]))
    others = [np.asarray(v, dtype=np.float64) for k, v in parts.items()
              if k.endswith("_pos") and k not in (f"{moved}_pos", f"{target}_pos", "eef_pos")
              and not k.startswith("slot") and abs(v[2] - pos[2]) < RIM_LEVEL]
    reach = GRASPS[object_class(moved)].rim + FINGER_REACH
    base = float(np.arctan2(prefer[1], prefer[0]))
    steps = int(round(np.pi / RIM_TURN))
    for k in sorted(range(1 - steps, steps + 1), key=lambda k: (abs(k), -k)):  # 0, 1, -1, ...
        d = np.array([np.cos(base + k * RIM_TURN), np.sin(base + k * RIM_TURN)])
        if all(np.linalg.norm(pos[:2] + reach * d - o[:2]) >= RIM_CLEAR for o in others):
            return np.array([d[0], d[1], 0.0])
    return np.array([prefer[0], prefer[1], 0.0])


def waypoints(parts: dict, moved: str, target: str, start: Optional[np.ndarray] = None) -> list:
    """The expert's waypoints for moving object ``moved`` onto/into ``target``; ``parts``:
    the privileged vector by name (:func:`m2flow.envs.libero_privileged.privileged_layout`).

    ``start``: the hand's position at the start. The hand moves across the scene at its
    height (LIBERO starts it above every fixture, and the privileged state has no fixtures'
    poses, e.g. a cabinet between the hand and a bowl), and a rim is grasped on the side
    :func:`rim_side` picks. None: straight to above the object, a rim grasped on the hand's
    yaw-0 closing axis (world -y).

    >>> soup = dict(alphabet_soup_1_pos=np.array([0.1, -0.2, 0.04]),
    ...             alphabet_soup_1_quat=np.array([0, 0, 0, 1.0]),
    ...             basket_1_pos=np.array([0.0, 0.25, -0.005]), basket_1_quat=np.array([0, 0, 0, 1.0]))
    >>> [np.round(w.pos, 3).tolist() + [w.gripper] for w in waypoints(soup, "alphabet_soup_1", "basket_1")][:2]
    [[0.1, -0.2, 0.15, -1.0], [0.1, -0.2, 0.05, -1.0]]
    """
    grasp, place = GRASPS[object_class(moved)], PLACES[object_class(target)]
    pos, quat = parts[f"{moved}_pos"], parts[f"{moved}_quat"]
    yaw = yaw_of(quat) if grasp.align_yaw else 0.0
    travel_z = None if start is None else float(start[2])
    at = np.asarray(pos, dtype=np.float64).copy()
    if grasp.rim:  # the fingers close across the wall: along the rim's radius
        side = rim_side(parts, moved, target, start)
        yaw = closing_yaw(side)
        at += grasp.rim * side
    at[2] = pos[2] + grasp.dz
    above = at + [0, 0, CLEARANCE]
    goal = np.asarray(parts[f"{target}_pos"], dtype=np.float64)
    top = goal[2] + place.top
    carry_z = max(above[2], top + grasp.below + CARRY, travel_z or -np.inf)
    # over the target the held point keeps its offset from the object's centre (a rim grasp)
    over = goal + (at - np.asarray(pos)) * [1, 1, 0]
    over[2] = carry_z
    release = over.copy()
    release[2] = top + grasp.below + place.release
    travel = [] if travel_z is None or travel_z <= above[2] else [
        Waypoint(np.array([at[0], at[1], travel_z]), yaw, OPEN)]
    return travel + [
        Waypoint(above, yaw, OPEN),
        Waypoint(at, yaw, OPEN),
        Waypoint(at, yaw, CLOSE, hold=GRIPPER_STEPS),
        Waypoint(np.array([at[0], at[1], carry_z]), yaw, CLOSE),
        Waypoint(over, yaw, CLOSE),
        Waypoint(release, yaw, CLOSE),
        Waypoint(release, yaw, OPEN, hold=GRIPPER_STEPS),
        Waypoint(release + [0, 0, CLEARANCE], yaw, OPEN),
    ]


def rotation_error(target: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Axis-angle (world frame) of ``target @ current.T``: the rotation OSC_POSE must apply."""
    r = target @ current.T
    cos = np.clip((np.trace(r) - 1) / 2, -1.0, 1.0)
    angle = np.arccos(cos)
    if angle < 1e-6:
        return np.zeros(3)
    axis = np.array([r[2, 1] - r[1, 2], r[0, 2] - r[2, 0], r[1, 0] - r[0, 1]])
    n = np.linalg.norm(axis)
    if n < 1e-6:  # angle ~ pi: the axis from the symmetric part
        axis = np.sqrt(np.clip((np.diag(r) + 1) / 2, 0, None))
        n = np.linalg.norm(axis)
    return axis / n * angle


def action_towards(wp: Waypoint, eef_pos: np.ndarray, eef_quat: np.ndarray) -> np.ndarray:
    """The OSC_POSE action (7,) that moves the hand towards ``wp`` (proportional, clipped)."""
    dp = POS_GAIN * (np.asarray(wp.pos) - eef_pos) / POS_SCALE
    dr = ROT_GAIN * rotation_error(hand_down(wp.yaw), quat_to_mat(eef_quat)) / ROT_SCALE
    a = np.concatenate([np.clip(dp, -1, 1), np.clip(dr, -1, 1), [wp.gripper]])
    return a.astype(np.float32)


class LiberoExpert:
    """Steps through :func:`waypoints` from the privileged vector: ``reset(parts)`` plans,
    ``act(parts)`` returns the next action and moves on when a waypoint is reached (or held
    long enough, or left after :data:`WAYPOINT_STEPS`)."""

    def __init__(self, moved: str, target: str):
        self.moved, self.target = moved, target
        self.plan: list = []
        self.k = self.t = 0

    def reset(self, parts: dict) -> None:
        self.plan = waypoints(parts, self.moved, self.target, parts.get("eef_pos"))
        self.k = self.t = 0

    @property
    def done(self) -> bool:
        return self.k >= len(self.plan)

    def act(self, parts: dict) -> np.ndarray:
        pos, quat = np.asarray(parts["eef_pos"]), np.asarray(parts["eef_quat"])
        while not self.done and self._reached(self.plan[self.k], pos, quat):
            self.k, self.t = self.k + 1, 0
        wp = self.plan[min(self.k, len(self.plan) - 1)]
        self.t += 1
        return action_towards(wp, pos, quat)

    def _reached(self, wp: Waypoint, pos: np.ndarray, quat: np.ndarray) -> bool:
        if wp.hold:
            return self.t >= wp.hold
        if self.t >= WAYPOINT_STEPS:
            return True
        near = np.linalg.norm(np.asarray(wp.pos) - pos) < REACHED
        turned = np.linalg.norm(rotation_error(hand_down(wp.yaw), quat_to_mat(quat))) < REACHED_ROT
        return bool(near and turned)


def named(vector: np.ndarray, layout: Sequence) -> dict:
    """The privileged vector as ``{name: values}`` of ``layout``'s (name, slice) pairs."""
    return {name: np.asarray(vector[sl], dtype=np.float64) for name, sl in layout}


def expert_for(objects: Sequence[str]) -> Optional[LiberoExpert]:
    """The expert of a task whose objects (in slot order) are ``objects``, or None when it
    has no grasp for slot 0's class or no place for slot 1's."""
    if len(objects) < 2:
        return None
    moved, target = objects[0], objects[1]
    if object_class(moved) not in GRASPS or object_class(target) not in PLACES:
        return None
    return LiberoExpert(moved, target)
