"""The motion planner ManiSkill's motion-planning solutions run with in ``m2flow-demos``.

mani-skill 3.0.1 pins mplib 0.1.1, whose ``Planner()`` crashes (null pointer in its Eigen
conversion) under numpy 2 (ManiSkill issue #1100). The solutions plan with
``plan_screw`` only, so :class:`ScrewPlanner` reimplements it (mplib 0.1.1's screw motion:
pseudo-inverse Jacobian steps of 0.1 rad, joint limits, TOPP-RA time parameterisation at the
control step) on SAPIEN's own Pinocchio model, without mplib's self-collision check: the screw
motions of PushCube and PickCube stay well clear of the arm itself.

Use: ``with screw_planner(): solvePickCube(env, seed=...)``.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np


class ScrewPlanner:
    """mplib 0.1.1's ``Planner.plan_screw`` (what ManiSkill's solutions call) on SAPIEN's
    Pinocchio model (see the module docstring for why)."""

    def __init__(self, robot, ee_link: int, arm: list, base_pose, vel: float, acc: float):
        self.pin = robot.create_pinocchio_model()
        self.ee, self.arm = ee_link, np.asarray(arm)
        self.limits = robot.get_qlimits()[0].cpu().numpy()  # (n, 2)
        self.joint_vel_limits = np.full(len(arm), float(vel))
        self.joint_acc_limits = np.full(len(arm), float(acc))
        self.base = _matrix(np.concatenate([base_pose.p, base_pose.q]))

    def plan_screw(self, target_pose, qpos, qpos_step: float = 0.1, time_step: float = 0.1,
                   use_point_cloud: bool = False, **_) -> dict:
        """Joint path (position, velocity, ... per control step) to ``target_pose`` (world
        frame, [x, y, z, qw, qx, qy, qz]) along the screw motion from the current pose."""
        qpos = np.array(qpos, dtype=np.float64)
        target = np.linalg.inv(self.base) @ _matrix(np.asarray(target_pose, dtype=np.float64))
        self.pin.compute_forward_kinematics(qpos)
        p = self.pin.get_link_pose(self.ee)
        twist, theta = _exp_coordinates(target @ np.linalg.inv(
            _matrix(np.concatenate([p.p, p.q]))))
        if twist is None:
            return {"status": "screw plan failed."}
        twist = twist * theta  # (6,) [v, w], base frame
        path = [qpos[self.arm].copy()]
        while True:
            self.pin.compute_full_jacobian(qpos)
            jac = self.pin.get_link_jacobian(self.ee, local=False)  # (6, n)
            dq = np.linalg.pinv(jac) @ twist
            dq *= qpos_step / np.linalg.norm(dq)
            step = jac @ dq
            last = np.linalg.norm(step) > np.linalg.norm(twist)
            if last:  # the final, shorter step
                ratio = np.linalg.norm(twist) / np.linalg.norm(step)
                dq, step = dq * ratio, step * ratio
            qpos += dq
            twist = twist - step
            inside = np.all((qpos >= self.limits[:, 0] - 1e-3) & (qpos <= self.limits[:, 1] + 1e-3))
            if np.linalg.norm(step) < 1e-4 or not inside:
                return {"status": "screw plan failed"}
            path.append(qpos[self.arm].copy())
            if last:
                return self._time_parameterise(np.vstack(path), time_step)

    def _time_parameterise(self, path: np.ndarray, step: float) -> dict:
        """mplib's ``TOPP``: TOPP-RA under the joint velocity and acceleration limits."""
        import toppra as ta
        import toppra.algorithm as algo
        import toppra.constraint as constraint

        ta.setup_logging("WARNING")
        spline = ta.SplineInterpolator(np.linspace(0, 1, path.shape[0]), path)
        limits = [constraint.JointVelocityConstraint(self.joint_vel_limits),
                  constraint.JointAccelerationConstraint(self.joint_acc_limits)]
        traj = algo.TOPPRA(limits, spline, parametrizer="ParametrizeConstAccel").compute_trajectory()
        if traj is None:
            return {"status": "screw plan failed: no time parameterisation"}
        ts = np.linspace(0, traj.duration, int(traj.duration / step))
        return {"status": "Success", "time": ts, "position": traj(ts), "velocity": traj(ts, 1),
                "acceleration": traj(ts, 2), "duration": traj.duration}


def _matrix(pose7: np.ndarray) -> np.ndarray:
    from transforms3d.quaternions import quat2mat

    m = np.eye(4)
    m[:3, 3], m[:3, :3] = pose7[:3], quat2mat(pose7[3:])
    return m


def _exp_coordinates(T: np.ndarray):
    """(unit screw (6,), angle) of a rigid transform, as mplib 0.1.1's ``pose2exp_coordinate``
    (a pure translation: rotation 0 and angle 1); (None, nan) for a half turn."""
    rot = T[:3, :3]
    trace = np.trace(rot)
    if np.isclose(trace, 3):
        omega, theta = np.zeros(3), 1.0
    elif np.isclose(trace, -1):
        return None, float("nan")
    else:
        theta = float(np.arccos((trace - 1) / 2))
        omega = np.array([rot[2, 1] - rot[1, 2], rot[0, 2] - rot[2, 0],
                          rot[1, 0] - rot[0, 1]]) / (2 * np.sin(theta))
    ss = np.array([[0, -omega[2], omega[1]], [omega[2], 0, -omega[0]], [-omega[1], omega[0], 0]])
    inv_left_jacobian = (np.eye(3) / theta - 0.5 * ss
                         + (1.0 / theta - 0.5 / np.tan(theta / 2)) * ss @ ss)
    return np.concatenate([inv_left_jacobian @ T[:3, 3], omega]), theta


@contextmanager
def screw_planner():
    """ManiSkill's motion-planning solvers plan with :class:`ScrewPlanner` inside this block."""
    from mani_skill.examples.motionplanning.base_motionplanner import motionplanner as mp

    def setup_planner(solver):
        robot = solver.robot
        link = robot.links_map[solver.MOVE_GROUP]
        names = [j.name for j in robot.get_active_joints()]
        arm = [names.index(n) for n in solver.env_agent.arm_joint_names]
        index = int(np.asarray(link.index.cpu() if hasattr(link.index, "cpu") else link.index)
                    .reshape(-1)[0])
        return ScrewPlanner(robot, index, arm, solver.base_pose, solver.joint_vel_limits,
                            solver.joint_acc_limits)

    original = mp.BaseMotionPlanningSolver.setup_planner
    mp.BaseMotionPlanningSolver.setup_planner = setup_planner
    try:
        yield
    finally:
        mp.BaseMotionPlanningSolver.setup_planner = original
