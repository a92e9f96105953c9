"""Do LIBERO's saved init states still hold under the installed MuJoCo?

RLinf pins MuJoCo 3.3.0 for LIBERO ("≥ 3.4.0 desyncs LIBERO's saved init states"); m2flow
runs LIBERO on MuJoCo 3.11. An init state is robosuite's flat MuJoCo state
``[time, qpos (nq), qvel (nv)]`` saved by LIBERO's authors; robosuite's
``set_state_from_flattened`` slices it by the *current* model's ``nq`` and ``nv`` without
checking its length, so a model that compiles to other sizes would read the wrong numbers
silently. Per init state, :func:`check_task` checks the three ways a state can desync:

1. **size**: the saved vector is ``1 + nq + nv`` long for the model this MuJoCo compiles;
2. **set**: after LIBERO's ``set_init_state``, every movable object's pose as MuJoCo's
   kinematics puts it (robosuite's ``<object>_pos`` / ``_quat`` observations, from
   ``xpos`` / ``xquat``) equals the pose in the saved vector (the object's free joint's qpos
   at ``jnt_qposadr``);
3. **settle**: after ``settle_steps`` no-op steps (the adapter's, as OpenVLA's evaluation
   does) the objects are where the reference MuJoCo (3.3.0, RLinf's pin) puts them, within
   :data:`SETTLE_TOLERANCE`: a state whose contacts the new MuJoCo resolves differently
   (objects interpenetrating, or resting on nothing) would make objects jump, sink or fall
   elsewhere. Objects do move while settling under either version (LIBERO-Object's basket
   drops a few cm from every saved state), so the drift alone says nothing: the positions
   after settling are compared with those recorded under 3.3.0 (``--record``).

    python -m m2flow.envs.libero_init_states libero_object libero_spatial   # a row per task
    python -m m2flow.envs.libero_init_states --states 5 --record X.npz     # under MuJoCo 3.3.0
    python -m m2flow.envs.libero_init_states --states 5 --against X.npz    # then under 3.11
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

SET_TOLERANCE = 1e-6  # m and quaternion units: the pose is the saved qpos up to float error
SETTLE_TOLERANCE = 0.001  # m: the same state settled under two MuJoCo versions


@dataclass
class TaskCheck:
    """One task's init states under the installed MuJoCo."""

    suite: str
    task: int
    states: int
    size_ok: bool
    """Every saved vector is 1 + nq + nv long."""
    set_error: float
    """Largest |pose after set - saved pose| over states and objects (position m, quat)."""
    settle_drift: float
    """Largest distance an object moved in the settle steps, over states and objects (m)."""
    worst: str
    """The object and init state of ``settle_drift``."""
    settled: np.ndarray
    """(states, objects, 3): each object's position after the settle steps (objects in
    ``objects_dict`` order, those with a free joint)."""

    @property
    def ok(self) -> bool:
        """Size and set hold (settling is judged against a reference: :func:`settle_gap`)."""
        return self.size_ok and self.set_error <= SET_TOLERANCE


def settle_gap(settled: np.ndarray, reference: np.ndarray) -> float:
    """The largest distance (m) between an object's settled position here and in the
    reference, over states and objects; inf if they are not the same states and objects."""
    if settled.shape != reference.shape:
        return float("inf")
    return float(np.linalg.norm(settled - reference, axis=-1).max())


def saved_poses(sim, objects: dict, state: np.ndarray) -> dict:
    """{object: (position (3,), quaternion (4,) x y z w)} read from the saved flat ``state``
    at each object's free joint's qpos address (MuJoCo's quaternions are w x y z)."""
    out = {}
    for name, obj in objects.items():
        if not obj.joints:  # fixed to the world (not movable): no pose in qpos
            continue
        adr = sim.model.get_joint_qpos_addr(obj.joints[-1])
        q = state[1 + adr[0]:1 + adr[1]] if isinstance(adr, tuple) else state[1 + adr:2 + adr]
        if len(q) != 7:
            continue
        out[name] = (np.asarray(q[:3]), np.asarray([q[4], q[5], q[6], q[3]]))
    return out


def check_task(suite: str, task: int, settle_steps: int = 10,
               states: int | None = None) -> TaskCheck:
    """Sets each of the task's saved init states (the first ``states``; None: all) in LIBERO's
    own env and checks size, set and settle (the module docstring)."""
    from m2flow.envs import libero

    libero.robosuite_on_new_mujoco()
    libero.prepare()
    from libero.libero.envs import OffScreenRenderEnv

    _, _, bddl, init_file = libero.suite_tasks(suite)[task]
    init = libero._load_init_states(init_file)[:states]
    env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=32, camera_widths=32,
                             has_offscreen_renderer=False, use_camera_obs=False)
    try:
        env.reset()
        sim = env.env.sim  # the same MjSim across resets (robosuite rebuilds it in place)
        size = 1 + sim.model.nq + sim.model.nv
        size_ok = all(len(s) == size for s in init)
        set_error, drift, worst = 0.0, 0.0, ""
        if not size_ok:
            return TaskCheck(suite, task, len(init), False, np.inf, np.inf,
                             f"saved {len(init[0])} numbers, the model has {size}",
                             np.zeros((0, 0, 3)))
        settled = []
        for i, state in enumerate(init):
            # as the adapter's reset with seed i: LIBERO places the fixtures (cabinet, stove;
            # not in the init states) with np.random at each reset, so the scene needs its seed
            np.random.seed(i)
            env.reset()
            sim = env.env.sim
            obs = env.set_init_state(state)
            poses = saved_poses(sim, env.env.objects_dict, state)
            for name, (pos, quat) in poses.items():
                q = obs[f"{name}_quat"]
                qerr = min(np.abs(q - quat).max(), np.abs(q + quat).max())  # q ~ -q
                set_error = max(set_error, float(np.abs(obs[f"{name}_pos"] - pos).max()), qerr)
            for _ in range(settle_steps):
                obs, _, _, _ = env.step(libero.NOOP)
            for name, (pos, _) in poses.items():
                d = float(np.linalg.norm(obs[f"{name}_pos"] - pos))
                if d > drift:
                    drift, worst = d, f"{name} from init state {i}"
            settled.append([obs[f"{name}_pos"] for name in poses])
        return TaskCheck(suite, task, len(init), True, set_error, drift, worst,
                         np.asarray(settled, dtype=np.float64))
    finally:
        env.close()


def main(argv: list[str]) -> int:
    """Prints a row per task of the suites named (default: the two pick-and-place suites);
    ``--states N``: each task's first N init states only; ``--record X.npz`` saves the settled
    positions, ``--against X.npz`` compares with saved ones. Exit 1 if any desyncs."""
    import argparse

    import mujoco

    from m2flow.envs.libero import SUITE_NUM_TASKS

    parser = argparse.ArgumentParser(prog="python -m m2flow.envs.libero_init_states")
    parser.add_argument("suites", nargs="*", default=["libero_object", "libero_spatial"])
    parser.add_argument("--states", type=int, default=None, help="first N init states per task")
    parser.add_argument("--tasks", type=int, nargs="*", default=None,
                        help="task indices of each suite (default: all)")
    parser.add_argument("--record", default=None, help="write the settled positions here")
    parser.add_argument("--against", default=None, help="compare with these settled positions")
    args = parser.parse_args(argv)
    reference = dict(np.load(args.against)) if args.against else {}
    bad, record = 0, {}
    print(f"MuJoCo {mujoco.__version__}; tolerances: set {SET_TOLERANCE}, settle "
          f"{SETTLE_TOLERANCE} m", flush=True)
    for suite in args.suites:
        for task in args.tasks if args.tasks is not None else range(SUITE_NUM_TASKS[suite]):
            c = check_task(suite, task, states=args.states)
            key = f"{suite}_task{task}"
            record[key] = c.settled
            gap = settle_gap(c.settled, reference[key]) if key in reference else None
            ok = c.ok and (gap is None or gap <= SETTLE_TOLERANCE)
            bad += not ok
            vs = "" if gap is None else f", {gap * 1000:.3f} mm from the reference"
            print(f"{suite} task {task}: {c.states} states, size {'ok' if c.size_ok else 'BAD'}, "
                  f"set error {c.set_error:.1e}, settle drift {c.settle_drift * 1000:.2f} mm "
                  f"({c.worst}){vs} {'ok' if ok else 'DESYNC'}", flush=True)
    if args.record:
        np.savez_compressed(args.record, mujoco=mujoco.__version__, **record)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
