"""LIBERO's privileged state (``env.privileged_state=true``): its documented layout
(:func:`m2flow.envs.libero_privileged.privileged_layout`) holds, slice by slice, what robosuite's own
observation of the same scene says (``state`` mode: the vector is built from robosuite's
observation the same way with cameras on); without the flag there is no such key."""

import numpy as np
import torch

from m2flow.envs import env_config, make_env
from m2flow.envs.libero import NOOP, _load_init_states, prepare, suite_tasks
from m2flow.envs.libero_compat import robosuite_on_new_mujoco
from m2flow.envs.libero_privileged import privileged_dim, privileged_layout, task_objects

SUITE, TASK, SEED = "libero_object", 0, 3


def raw_observation(suite: str, task: int, init_state: int, settle_steps: int) -> dict:
    """robosuite's observation dict after LIBERO's own env sets the init state and settles
    (no m2flow adapter)."""
    robosuite_on_new_mujoco()
    prepare()
    from libero.libero.envs import OffScreenRenderEnv

    _, _, bddl, init = suite_tasks(suite)[task]
    env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=32, camera_widths=32,
                             has_offscreen_renderer=False, use_camera_obs=False)
    try:
        env.reset()
        obs = env.set_init_state(_load_init_states(init)[init_state])
        for _ in range(settle_steps):
            obs, _, _, _ = env.step(NOOP)
        return obs
    finally:
        env.close()


def test_the_layout_names_every_part_once_without_gaps():
    objects = task_objects(suite_tasks(SUITE)[TASK][2])
    assert objects[:2] == ("alphabet_soup_1", "basket_1")  # the BDDL's obj_of_interest
    layout = privileged_layout(objects, len(objects) + 1)
    assert [n for n, _ in layout][:3] == ["eef_pos", "eef_quat", "gripper_qpos"]
    assert layout[-1][0] == f"slot{len(objects)}_quat"
    ends = [(s.start, s.stop) for _, s in layout]
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:])) and ends[0][0] == 0
    assert ends[-1][1] == privileged_dim(len(objects) + 1) == 9 + 7 * (len(objects) + 1)


def test_privileged_slices_equal_robosuites_own_observation():
    env = make_env(env_config(name=f"LIBERO/{SUITE}", num_envs=1, obs_mode="state",
                              privileged_state=True, task_ids=[TASK]))
    try:
        objects = task_objects(suite_tasks(SUITE)[TASK][2])
        assert env.spec.obs_shapes["privileged"] == (privileged_dim(len(objects)),)
        got = env.reset(seed=[SEED])["obs"]["privileged"][0].numpy()
        assert got.dtype == np.float32
    finally:
        env.close()
    raw = raw_observation(SUITE, TASK, SEED, settle_steps=10)
    for name, sl in privileged_layout(objects, len(objects)):
        want = raw[f"robot0_{name}"] if name in ("eef_pos", "eef_quat", "gripper_qpos") \
            else raw[name]
        np.testing.assert_allclose(got[sl], want, atol=1e-5, err_msg=name)
    # the poses differ from object to object: a swapped slot would fail above
    assert len({tuple(np.round(raw[f"{o}_pos"], 3)) for o in objects}) == len(objects)


def test_a_vision_env_without_the_flag_has_no_privileged_key():
    env = make_env(env_config(name=f"LIBERO/{SUITE}", num_envs=1, obs_mode="state",
                              task_ids=[TASK]))
    try:
        assert "privileged" not in env.spec.obs_shapes
        assert "privileged" not in env.reset(seed=[0])["obs"].keys()
        assert env.step(torch.zeros(1, 7))["next", "obs"]["state"].shape == (1, 8)
    finally:
        env.close()
