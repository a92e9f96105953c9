"""m2flow-demos: ManiSkill's motion-planning solutions, converted and replayed in m2flow's env,
written in ManiSkill's trajectory format."""

import json

import h5py
import numpy as np
import pytest
import torch

from m2flow.configs import ConfigError
from m2flow.embodied.demos import maniskill as demos_mod
from m2flow.embodied.demos.screw_planner import _exp_coordinates
from m2flow.envs import make_env

# PushCube seeds 2 and 3 reach success after 59 and 65 steps of pd_ee_delta_pos: a time limit
# of 61 keeps the first and rejects the second
LIMIT = 61
OVERRIDES = ["env=maniskill_pushcube_rgb", "env.image_size=16", f"env.max_episode_steps={LIMIT}",
             "demos.seed=2", "demos.episodes=2", "demos.max_tries=2"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("demos") / "push16"
    cfg = demos_mod.load_demos_config(overrides=[*OVERRIDES, f"demos.output={out}"])
    lines = []
    demos, tally, spec = demos_mod.generate(cfg, log=lines.append)
    h5_path, json_path = demos_mod.save(demos_mod.output_stem(cfg), demos, cfg.env, spec)
    return cfg, demos, tally, h5_path, json_path, lines


def test_only_successful_episodes_are_kept(recorded):
    cfg, demos, tally, _, json_path, lines = recorded
    assert tally.tried == 2 and 1 <= tally.kept < tally.tried and len(lines) == tally.tried
    meta = json.loads(json_path.read_text())
    assert len(meta["episodes"]) == len(demos) == tally.kept
    for demo, ep in zip(demos, meta["episodes"]):
        # each episode ends at its first success, within the env's time limit
        assert demo.success[-1] and not demo.success[:-1].any() and len(demo.actions) <= LIMIT
        assert ep["success"] is True and ep["elapsed_steps"] == len(demo.actions)
        assert ep["reset_kwargs"] == {"seed": demo.seed} and ep["control_mode"] == "pd_ee_delta_pos"
    assert meta["env_info"]["env_id"] == "PushCube-v1" and meta["source_type"] == "motionplanning"
    assert meta["env_info"]["max_episode_steps"] == LIMIT
    assert meta["prompt"] == "In: What action should the robot take to ?\nOut:"


def test_the_dataset_loads_back_with_identical_arrays(recorded):
    _, demos, _, h5_path, _, _ = recorded
    with h5py.File(h5_path, "r") as f:
        assert sorted(f.keys()) == [f"traj_{i}" for i in range(len(demos))]
        for i, demo in enumerate(demos):
            g = f[f"traj_{i}"]
            assert sorted(g["obs"].keys()) == ["rgb", "state"]
            t = len(demo.actions)
            assert g["obs/rgb"].shape == (t + 1, 16, 16, 3) and g["obs/rgb"].dtype == np.uint8
            for key, value in demo.obs.items():
                np.testing.assert_array_equal(g["obs"][key][:], value)
            np.testing.assert_array_equal(g["actions"][:], demo.actions)
            assert g["actions"].dtype == np.float32 and g["actions"].shape == (t, 4)
            for name in ("success", "terminated", "truncated"):
                np.testing.assert_array_equal(g[name][:], getattr(demo, name))


def test_saved_observations_are_what_m2flows_env_gives(recorded):
    """Independent of the generator: m2flow's env, reset from the episode's seed and stepped
    with the saved actions, shows the saved observations."""
    cfg, _, _, h5_path, json_path, _ = recorded
    ep = json.loads(json_path.read_text())["episodes"][0]
    env = make_env(cfg.env)
    try:
        with h5py.File(h5_path, "r") as f:
            g = f["traj_0"]
            obs = env.reset(seed=[ep["episode_seed"]], rebuild=True)["obs"]
            for t, action in enumerate(g["actions"][:]):
                for key in ("rgb", "state"):
                    np.testing.assert_array_equal(obs[key][0].numpy(), g["obs"][key][t])
                out = env.step(torch.from_numpy(action)[None])
                obs = out["next", "obs"]
            assert bool(out["next", "success"][0])
            np.testing.assert_array_equal(obs["state"][0].numpy(), g["obs/state"][-1])
    finally:
        env.close()


def test_bad_input_is_one_line(tmp_path):
    for overrides, fragment in (
        (["env.name=ManiSkill/PullCube-v1"], "m2flow-demos has motion-planning solutions for"),
        (["env=gym_pendulum"], "env.visual_mesh_fraction is not a field of GymEnvConfig"),
        (["env.control_mode=pd_ee_pose"], "env.control_mode='pd_ee_pose'"),
        (["demos.episodez=3"], "Did you mean demos.episodes?"),
        (["demos.episodes=0"], "demos.episodes and demos.max_tries must be >= 1"),
    ):
        with pytest.raises(ConfigError) as e:
            demos_mod.load_demos_config(overrides=[*overrides, f"demos.output={tmp_path}/x"])
        assert fragment in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "x.h5").write_text("")
    with pytest.raises(ConfigError, match="x.h5 exists; pick another demos.output or set"):
        demos_mod.load_demos_config(overrides=[f"demos.output={tmp_path}/x"])
    from m2flow.cli.common import EXIT_CONFIG
    from m2flow.cli.demos import main

    assert main([f"demos.output={tmp_path}/x"]) == EXIT_CONFIG


def test_screw_motion_exp_coordinates_match_a_hand_computed_one():
    # a quarter turn about z with a translation: the screw axis is z, the angle pi/2
    T = np.eye(4)
    T[:3, :3] = [[0, -1, 0], [1, 0, 0], [0, 0, 1]]
    T[:3, 3] = [1.0, 0.0, 0.5]
    twist, theta = _exp_coordinates(T)
    assert theta == pytest.approx(np.pi / 2)
    np.testing.assert_allclose(twist[3:], [0, 0, 1], atol=1e-12)
    # the screw's exponential (Lynch & Park, eq. 3.88) must give T back
    from scipy.linalg import expm

    S = np.zeros((4, 4))
    w, v = twist[3:], twist[:3]
    S[:3, :3] = [[0, -w[2], w[1]], [w[2], 0, -w[0]], [-w[1], w[0], 0]]
    S[:3, 3] = v
    np.testing.assert_allclose(expm(S * theta), T, atol=1e-9)
