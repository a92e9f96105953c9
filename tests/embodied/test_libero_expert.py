"""The scripted LIBERO expert (:mod:`m2flow.embodied.demos.libero_expert`) and its recorder
(:mod:`m2flow.embodied.demos.libero`): the waypoints against poses worked out by hand, the
OSC_POSE action against the controller's scaling, and a recorded demo that, replayed through
a fresh env from its init state, reaches the same success at the same step."""

import json

import numpy as np
import pytest
import torch

from m2flow.embodied.demos import libero_expert as ex

BOWL = dict(akita_black_bowl_1_pos=np.array([0.1, 0.2, 0.9]),
            akita_black_bowl_1_quat=np.array([0, 0, 0, 1.0]),
            plate_1_pos=np.array([0.0, 0.0, 0.9]), plate_1_quat=np.array([0, 0, 0, 1.0]))


def test_bowl_waypoints_grasp_the_rim_and_release_over_the_plate():
    # by hand: the hand points down at yaw 0, its fingers close along world -y, so the rim
    # grasp is 0.045 m from the bowl's centre along y, 0.035 m above its bottom; the carry
    # height clears the plate's top (0.92) by the bowl's 0.035 below the grasp + 0.08
    w = ex.waypoints(BOWL, "akita_black_bowl_1", "plate_1")
    np.testing.assert_allclose(w[1].pos, [0.1, 0.155, 0.935])  # at the rim, open
    np.testing.assert_allclose(w[0].pos, [0.1, 0.155, 1.035])  # 0.10 above it
    assert (w[1].gripper, w[2].gripper, w[2].hold) == (ex.OPEN, ex.CLOSE, ex.GRIPPER_STEPS)
    np.testing.assert_allclose(w[3].pos, [0.1, 0.155, 1.035])  # lifted
    np.testing.assert_allclose(w[4].pos, [0.0, -0.045, 1.035])  # the bowl's centre over the plate's
    np.testing.assert_allclose(w[5].pos, [0.0, -0.045, 0.965])  # 0.01 above the plate's top
    assert w[6].gripper == ex.OPEN and all(p.yaw == 0.0 for p in w)


@pytest.mark.parametrize("turn", [np.pi / 6, np.pi / 6 + np.pi])
def test_a_box_is_grasped_across_its_short_side(turn):
    q = np.array([0, 0, np.sin(turn / 2), np.cos(turn / 2)])  # turned about the vertical
    parts = dict(cream_cheese_1_pos=np.array([0.0, 0.0, 0.01]), cream_cheese_1_quat=q,
                 basket_1_pos=np.array([0.0, 0.3, 0.0]), basket_1_quat=np.array([0, 0, 0, 1.0]))
    w = ex.waypoints(parts, "cream_cheese_1", "basket_1")
    assert w[1].yaw == pytest.approx(np.pi / 6)  # a box turned by pi is the same box
    fingers = ex.hand_down(w[1].yaw)[:, 1]  # the closing axis
    long_axis = np.array([np.cos(np.pi / 6), np.sin(np.pi / 6), 0])
    assert abs(fingers @ long_axis) < 1e-9
    np.testing.assert_allclose(w[1].pos, [0.0, 0.0, 0.01])


def test_the_action_is_the_error_in_controller_units():
    down = ex.hand_down(0.0)
    np.testing.assert_allclose(down, ex.quat_to_mat([1.0, 0, 0, 0]))  # (x y z w): Rx(pi)
    # 1 cm off in x, turned 0.1 rad about the vertical: OSC_POSE scales by 0.05 m and 0.5 rad
    wp = ex.Waypoint(np.array([0.11, 0.0, 0.2]), 0.0, ex.CLOSE)
    q = np.array([np.cos(0.05), np.sin(0.05), 0, 0])  # Rz(0.1) Rx(pi) as (x y z w)
    np.testing.assert_allclose(ex.quat_to_mat(q), ex.hand_down(0.1), atol=1e-12)
    a = ex.action_towards(wp, np.array([0.10, 0.0, 0.2]), q)
    np.testing.assert_allclose(a, [0.2, 0, 0, 0, 0, -0.2, 1.0], atol=1e-6)


def test_the_expert_moves_on_when_a_waypoint_is_reached():
    expert = ex.LiberoExpert("akita_black_bowl_1", "plate_1")
    expert.reset(BOWL)
    first = expert.plan[0]
    q = np.array([1.0, 0, 0, 0])
    expert.act(dict(eef_pos=first.pos + [0.05, 0, 0], eef_quat=q))
    assert expert.k == 0
    expert.act(dict(eef_pos=first.pos, eef_quat=q))
    assert expert.k == 1


@pytest.mark.slow  # ~5 min on the shared 2-core VM (two LIBERO envs, ~120 steps each)
def test_a_recorded_demo_replays_to_the_same_success(tmp_path):
    from m2flow.embodied.demos import libero as rec
    from m2flow.envs import make_env

    cfg = rec.load_demos_config(overrides=[
        "env=libero_object", "env.obs_mode=rgb", "env.image_size=32", "env.task_ids=[0]",
        "demos.init_states_per_task=1", "demos.first_init_state=2",
        f"demos.output={tmp_path}/d"])
    demos, tally, spec = rec.generate(cfg, log=lambda line: None)
    assert tally.per_task == {0: [1, 1]} and len(demos) == 1
    h5_path, json_path = rec.save(rec.output_stem(cfg), demos, cfg.env, spec, tally)
    import h5py

    with h5py.File(h5_path) as f:
        g = f["traj_0"]
        actions = g["actions"][:]
        assert set(g["obs"]) == {"rgb", "wrist_rgb", "state", "privileged", "task"}
        assert g["obs/rgb"].shape == (len(actions) + 1, 32, 32, 3)
        priv = g["obs/privileged"][:]
        assert g["success"][-1] and not g["success"][:-1].any()
    meta = json.loads(json_path.read_text())
    ep = meta["episodes"][0]
    assert ep["task"] == 0 and ep["init_state"] == 2 and "alphabet soup" in ep["language_instruction"]
    assert meta["success_per_task"]["0"]["success"] == 1.0
    env = make_env(cfg.env)  # a fresh env: the actions alone must solve the task again
    try:
        out = env.reset(seed=[ep["init_state"]], task=[ep["task"]])
        np.testing.assert_allclose(out["obs"]["privileged"][0].numpy(), priv[0], atol=1e-6)
        for t, a in enumerate(actions):
            nxt = env.step(torch.from_numpy(a)[None])["next"]
            assert bool(nxt["success"][0]) == (t == len(actions) - 1)
        np.testing.assert_allclose(nxt["obs"]["privileged"][0].numpy(), priv[-1], atol=1e-4)
    finally:
        env.close()


def test_from_the_start_pose_the_hand_travels_high_and_grasps_the_rim_between_start_and_plate():
    # by hand: the bowl at (0.1, 0.2), the hand starting at (0.1, 0.0, 1.2) (along -y from
    # it), the plate at (0.3, 0.2) (along +x): the rim side is their bisector (1, -1)/sqrt(2),
    # the rim point 0.045 m along it, (0.1 + 0.045/sqrt(2), 0.2 - 0.045/sqrt(2)); the fingers
    # close along (1, -1)/sqrt(2): yaw pi/4 (hand_down's y axis is (sin, -cos, 0)); the hand
    # moves across at its start height, which also becomes the carry height
    parts = dict(BOWL, plate_1_pos=np.array([0.3, 0.2, 0.9]))
    w = ex.waypoints(parts, "akita_black_bowl_1", "plate_1", start=np.array([0.1, 0.0, 1.2]))
    r = 0.045 / np.sqrt(2)
    np.testing.assert_allclose(w[0].pos, [0.1 + r, 0.2 - r, 1.2], atol=1e-12)  # across, at 1.2
    np.testing.assert_allclose(w[2].pos, [0.1 + r, 0.2 - r, 0.935], atol=1e-12)  # the rim
    assert all(p.yaw == pytest.approx(np.pi / 4) for p in w)
    np.testing.assert_allclose(ex.hand_down(w[2].yaw)[:, 1], [r / 0.045, -r / 0.045, 0], atol=1e-12)
    np.testing.assert_allclose(w[4].pos, [0.1 + r, 0.2 - r, 1.2], atol=1e-12)  # lifted to 1.2
    np.testing.assert_allclose(w[5].pos, [0.3 + r, 0.2 - r, 1.2], atol=1e-12)  # over the plate
    np.testing.assert_allclose(w[6].pos, [0.3 + r, 0.2 - r, 0.965], atol=1e-12)  # 0.01 above it


def test_the_rim_side_turns_away_from_a_ramekin_beside_the_bowl():
    # by hand: as above, the bisector at -45 degrees, and a ramekin 0.1 m along it on the
    # bowl's level; the open outer finger's face 0.045 + 0.05 = 0.095 m out along the side
    # turned by a is sqrt(0.095^2 + 0.1^2 - 2 0.095 0.1 cos a) from the ramekin's centre:
    # 0.026, 0.051, 0.075 m at 15, 30, 45 degrees (under 0.08), 0.098 at 60: the side turns
    # by +60 degrees (the positive turn first) to +15 degrees, (cos 15, sin 15); the fingers
    # close along it: yaw 105 degrees less 180, -75. An object above the bowl's level (a
    # bowl on a box, 0.1 m up) does not count.
    s = np.array([np.cos(-np.pi / 4), np.sin(-np.pi / 4)])
    near = np.array([0.1, 0.2]) + 0.1 * s
    parts = dict(BOWL, plate_1_pos=np.array([0.3, 0.2, 0.9]),
                 glazed_rim_porcelain_ramekin_1_pos=np.array([near[0], near[1], 0.9]),
                 akita_black_bowl_2_pos=np.array([0.1 + 0.095 * s[0], 0.2 + 0.095 * s[1], 1.0]),
                 slot5_pos=np.zeros(3))
    w = ex.waypoints(parts, "akita_black_bowl_1", "plate_1", start=np.array([0.1, 0.0, 1.2]))
    c, n = np.cos(np.pi / 12), np.sin(np.pi / 12)
    np.testing.assert_allclose(w[2].pos, [0.1 + 0.045 * c, 0.2 + 0.045 * n, 0.935], atol=1e-12)
    assert w[2].yaw == pytest.approx(-5 * np.pi / 12)
    np.testing.assert_allclose(ex.hand_down(w[2].yaw)[:, 1], [-c, -n, 0], atol=1e-12)


@pytest.mark.parametrize("axis, yaw", [([0, -1], 0.0), ([0, 1], 0.0), ([1, 0], np.pi / 2 - np.pi),
                                       ([-1, 0], -np.pi / 2), ([-1, -1], -np.pi / 4),
                                       ([1, 1], 3 * np.pi / 4 - np.pi), ([-1, 1], -3 * np.pi / 4 + np.pi)])
def test_the_closing_yaw_keeps_the_last_joint_off_its_limit(axis, yaw):
    # by hand: hand_down(yaw)'s y axis is (sin yaw, -cos yaw): (0, -1) is yaw 0, (0, 1) yaw pi,
    # (1, 0) yaw pi/2, (-1, 0) -pi/2, (-1, -1) -pi/4, (1, 1) 3pi/4, (-1, 1) -3pi/4: within
    # [-pi/2, pi/2) after a turn by pi where needed (either finger may face the rim)
    assert ex.closing_yaw(axis) == pytest.approx(yaw)


def test_action_noise_runs_perturbed_actions_and_records_the_experts():
    """demos.action_noise (DART): the env runs the expert's action plus seeded noise on the
    arm's dims, ``actions`` records the expert's own, ``executed`` what ran; the same task and
    init state draw the same noise. A stand-in env (one that ends after 3 steps) and expert:
    what is checked is the recorder's bookkeeping, not LIBERO."""
    from tensordict import TensorDict

    from m2flow.embodied.demos import libero as rec

    class Env:
        def __init__(self):
            self.ran, self.t = [], 0

        def _obs(self, n):
            return TensorDict({"privileged": torch.zeros(n, 2), "state": torch.zeros(n, 8)},
                              batch_size=[n])

        def reset(self, seed, task):
            self.t = 0
            return TensorDict({"obs": self._obs(1)}, batch_size=[1])

        def step(self, action):
            self.ran.append(action[0].numpy().copy())
            self.t += 1
            end = self.t == 3
            nxt = TensorDict({"obs": self._obs(1), "success": torch.tensor([end]),
                              "reward": torch.tensor([float(end)]),
                              "terminated": torch.tensor([end]), "truncated": torch.tensor([False]),
                              "done": torch.tensor([end])}, batch_size=[1])
            return TensorDict({"next": nxt}, batch_size=[1])

    class Expert:
        def reset(self, named):
            self.k = 0

        def act(self, named):
            self.k += 1
            return np.array([0.1 * self.k, 0, 0, 0, 0, 0, 1.0], dtype=np.float32)

    layout = [("eef_pos", slice(0, 2))]
    env = Env()
    ok, demo = rec.record_episode(env, Expert(), layout, task=3, seed=7, action_noise=0.05)
    assert ok and demo.action_noise == 0.05
    expert = np.array([[0.1 * k, 0, 0, 0, 0, 0, 1.0] for k in (1, 2, 3)], dtype=np.float32)
    np.testing.assert_array_equal(demo.actions, expert)
    np.testing.assert_array_equal(demo.executed, np.stack(env.ran))
    noise = demo.executed - demo.actions
    assert np.all(noise[:, 6] == 0) and np.all(np.abs(noise[:, :6]) > 0)
    assert 0.01 < noise[:, :6].std() < 0.1
    again = rec.record_episode(Env(), Expert(), layout, task=3, seed=7, action_noise=0.05)[1]
    np.testing.assert_array_equal(again.executed, demo.executed)
    other = rec.record_episode(Env(), Expert(), layout, task=3, seed=8, action_noise=0.05)[1]
    assert not np.allclose(other.executed, demo.executed)
    clean = rec.record_episode(Env(), Expert(), layout, task=3, seed=7)[1]
    assert clean.executed is None and clean.action_noise == 0.0
