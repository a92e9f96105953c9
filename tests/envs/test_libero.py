"""LIBERO/<suite> on the real simulator (offline): every task of every suite builds, resets to
its init state and steps; images are upright, equal to LIBERO's own frames turned 180 degrees;
a seed gives one scene (init state and fixtures); without the wrist camera the agent view after
settle steps is LIBERO's, and a policy reading the wrist camera is refused; a 50-step
trajectory on the installed MuJoCo matches the one recorded under MuJoCo 3.3.7; bad configs
raise EnvError naming the field.

``python -m tests.envs.test_libero record PATH`` writes that trajectory (LIBERO's own env, no
m2flow adapter) under whichever MuJoCo the interpreter imports."""

import concurrent.futures
import multiprocessing as mp
import os

import numpy as np
import pytest
import torch

from m2flow.envs import EnvError, env_config, make_env
from m2flow.envs.libero import SUITE_MAX_STEPS, prepare
from m2flow.envs.libero_compat import robosuite_on_new_mujoco

SUITE_SIZES = {"libero_spatial": 10, "libero_object": 10, "libero_goal": 10, "libero_10": 10,
               "libero_90": 90}
SIZE = 64
HOLD = [0, 0, 0, 0, 0, 0, -1]  # no motion, gripper open
RECORD = os.path.join(os.path.dirname(__file__), "..", "records", "libero_spatial_mujoco337.npz")


def libero_languages(suite: str) -> list[str]:
    """The suite's task instructions, read through LIBERO's own benchmark API."""
    prepare()
    from libero.libero import benchmark

    bench = benchmark.get_benchmark_dict()[suite]()
    return [bench.get_task(i).language for i in range(bench.n_tasks)]


LONG_SUITES = ("libero_10", "libero_90")  # the long-horizon suites: with -m slow


@pytest.mark.parametrize("suite", [pytest.param(s, marks=pytest.mark.slow) if s in LONG_SUITES
                                   else s for s in SUITE_SIZES])
def test_every_task_of_the_suite_builds_resets_and_steps(suite):
    """Two env processes walk the suite two tasks at a time, switching task in-process
    (LIBERO-90's 90 tasks ~3 min, LIBERO-10's ~50 s: marked slow; Object, Spatial and Goal,
    the suites the recipes and the expert use, run in CI)."""
    n = SUITE_SIZES[suite]
    env = make_env(env_config(name=f"LIBERO/{suite}", num_envs=2, obs_mode="state",
                              settle_steps=0))
    try:
        assert list(env.spec.tasks) == libero_languages(suite)
        assert len(env.spec.tasks) == n
        assert all(isinstance(t, str) and " " in t for t in env.spec.tasks)
        assert env.spec.max_episode_steps == SUITE_MAX_STEPS[suite]
        assert env.spec.obs_shapes == {"state": (8,), "task": ()}
        assert env.spec.action_dim == 7
        for k in range(0, n, 2):
            tasks = [k, k + 1]
            obs = env.reset(seed=[k, k + 1], task=tasks)["obs"]
            assert obs["task"].tolist() == tasks, f"{suite} tasks {tasks}"
            assert obs["state"].shape == (2, 8) and obs["state"].dtype == torch.float32
            assert torch.isfinite(obs["state"]).all(), f"{suite} tasks {tasks}: {obs['state']}"
            out = env.step(torch.zeros(2, 7))
            nxt = out["next"]
            assert nxt["reward"].dtype == torch.float32 and torch.isfinite(nxt["reward"]).all()
            assert nxt["success"].dtype == torch.bool
            assert nxt["reward"].tolist() == [0.0, 0.0], f"{suite} tasks {tasks} solved at start"
            assert not nxt["success"].any() and not nxt["done"].any()
            assert not nxt["discarded"].any()
            assert out["obs", "task"].tolist() == tasks
            assert torch.isfinite(out["obs", "state"]).all()
        assert env.restarts == 0
    finally:
        env.close()


# -- images -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rgb_env():
    env = make_env(env_config(name="LIBERO/libero_spatial", num_envs=2, obs_mode="rgb",
                              image_size=SIZE, settle_steps=0))
    yield env
    env.close()


def raw_libero_frames(suite: str, task: int, seed: int, size: int, settle: int = 0):
    """LIBERO's own env (as OpenVLA's evaluation builds it), seeded (LIBERO places the fixtures
    with np.random), set to init state ``seed % 50`` and stepped ``settle`` times holding
    still: its raw agent-view and wrist frames. Runs in a child process (robosuite picks the
    GL backend at import)."""
    env, bench = libero_own_env(suite, task, size)
    try:
        env.seed(seed)
        env.reset()
        obs = env.set_init_state(bench.get_task_init_states(task)[seed % 50])
        for _ in range(settle):
            obs, _, _, _ = env.step(HOLD)
        return obs["agentview_image"].copy(), obs["robot0_eye_in_hand_image"].copy()
    finally:
        env.close()


def libero_own_env(suite: str, task: int, size: int):
    os.environ["MUJOCO_GL"] = "egl"
    robosuite_on_new_mujoco()
    prepare()
    from libero.libero import benchmark
    from libero.libero.envs import OffScreenRenderEnv

    bench = benchmark.get_benchmark_dict()[suite]()
    env = OffScreenRenderEnv(bddl_file_name=bench.get_task_bddl_file_path(task),
                             camera_heights=size, camera_widths=size)
    return env, bench


def libero_trajectory(steps: int = 50) -> dict:
    """LIBERO's own env, libero_spatial task 0 from init state 0 (fixtures seeded 0), driven by
    ``steps`` fixed random actions (uniform in [-0.5, 0.5], seed 0): the whole simulator state
    (qpos, qvel) after every step, the rewards, and the first and last agent-view frames."""
    import mujoco

    env, bench = libero_own_env("libero_spatial", 0, SIZE)
    try:
        env.seed(0)
        env.reset()
        obs = env.set_init_state(bench.get_task_init_states(0)[0])
        first = obs["agentview_image"].copy()
        actions = np.random.RandomState(0).uniform(-0.5, 0.5, (steps, 7))
        qpos, qvel, rewards = [], [], []
        for a in actions:
            obs, reward, _, _ = env.step(a)
            qpos.append(env.sim.data.qpos.copy())
            qvel.append(env.sim.data.qvel.copy())
            rewards.append(reward)
        return dict(qpos=np.stack(qpos), qvel=np.stack(qvel), rewards=np.array(rewards),
                    first=first, last=obs["agentview_image"].copy(),
                    mujoco=mujoco.__version__)
    finally:
        env.close()


def test_rgb_observations_are_upright_uint8_images_of_both_cameras(rgb_env):
    obs = rgb_env.reset(seed=[0, 1], task=[0, 1])["obs"]
    assert set(obs.keys()) == {"rgb", "wrist_rgb", "state", "task"}
    for key in ("rgb", "wrist_rgb"):
        assert obs[key].shape == (2, SIZE, SIZE, 3) and obs[key].dtype == torch.uint8
        assert rgb_env.spec.obs_shapes[key] == (SIZE, SIZE, 3)
        assert obs[key].float().std() > 10  # a scene, not a blank frame
    # upright agent view: the dark back of the room at the top, the bright table at the
    # bottom (measured at 128 px: row means ~110 top quarter vs ~160 bottom quarter)
    gray = obs["rgb"].float().mean(-1)  # (2, S, S)
    top, bottom = gray[:, : SIZE // 4].mean((1, 2)), gray[:, -SIZE // 4 :].mean((1, 2))
    assert (bottom - top > 25).all(), (top, bottom)
    out = rgb_env.step(torch.tensor([HOLD, HOLD], dtype=torch.float32))
    assert out["next", "obs", "rgb"].shape == (2, SIZE, SIZE, 3)
    assert out["obs", "wrist_rgb"].dtype == torch.uint8


def test_frames_are_libero_raw_frames_turned_180_degrees(rgb_env):
    tasks, seeds = [2, 7], [3, 54]  # seed 54: init state 54 % 50 = 4
    obs = rgb_env.reset(seed=seeds, task=tasks)["obs"]
    ctx = mp.get_context("forkserver")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
        jobs = [pool.submit(raw_libero_frames, "libero_spatial", t, s, SIZE)
                for t, s in zip(tasks, seeds)]
        raws = [job.result() for job in jobs]
    for i, (agent, wrist) in enumerate(raws):
        ours, ours_wrist = obs["rgb"][i].numpy(), obs["wrist_rgb"][i].numpy()
        assert not np.array_equal(ours, agent)  # the raw frame is upside down
        np.testing.assert_array_equal(ours, agent[::-1, ::-1])
        np.testing.assert_array_equal(ours_wrist, wrist[::-1, ::-1])


def test_what_an_openvla_policy_sees_equals_openvlas_own_libero_pipeline(rgb_env):
    """The env's frame through the policy's preprocessing (``prepare_images``: JPEG round trip,
    Lanczos3 to the model's size, 90% centre crop) equals OpenVLA's evaluation on LIBERO's raw
    frame: ``get_libero_image`` (turn 180 degrees), ``resize_image_for_policy``,
    ``center_crop_image`` -- transcribed in tests/policies/test_preprocess.py, with OpenCV's
    JPEG at TF's defaults."""
    import cv2

    from m2flow.policies.vla.preprocess import prepare_images
    from tests.policies.test_preprocess import openvla_center_crop_loop, tf_lanczos3_loop

    model_size = 48  # stands in for OpenVLA's 224 (the env renders 64, as 256 there)
    obs = rgb_env.reset(seed=[5, 5], task=[4, 4])["obs"]
    ctx = mp.get_context("forkserver")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        agent, _ = pool.submit(raw_libero_frames, "libero_spatial", 4, 5, SIZE).result()
    upright = np.ascontiguousarray(agent[::-1, ::-1])
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(upright, cv2.COLOR_RGB2BGR),
                           [cv2.IMWRITE_JPEG_QUALITY, 95])
    jpeg = cv2.cvtColor(cv2.imdecode(buf, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    ref = openvla_center_crop_loop(tf_lanczos3_loop(jpeg, model_size))
    ours = prepare_images(obs["rgb"][:1], model_size)[0].numpy()
    diff = np.abs(ours.astype(int) - ref)
    assert ok and diff.max() <= 1 and (diff == 0).mean() > 0.99  # float32 vs float64 rounding


@pytest.mark.slow  # 40 s of a second LIBERO process; CI: both cameras' frames above
def test_without_the_wrist_camera_the_agent_view_after_settle_steps_is_libero_s():
    """``env.wrist_camera=false``: no ``wrist_rgb`` in the spec or the observations; the agent
    view after 2 settle steps equals LIBERO's own env's (both cameras rendered, every step)
    after 2 steps holding still, turned 180 degrees: the frames a reset does not render
    (``libero_compat.frames_unrendered``) change nothing the policy sees."""
    env = make_env(env_config(name="LIBERO/libero_spatial", num_envs=1, obs_mode="rgb",
                              image_size=SIZE, settle_steps=2, wrist_camera=False))
    try:
        assert env.spec.obs_shapes == {"rgb": (SIZE, SIZE, 3), "state": (8,), "task": ()}
        obs = env.reset(seed=[3], task=[2])["obs"]
        out = env.step(torch.tensor([HOLD], dtype=torch.float32))
    finally:
        env.close()
    assert set(obs.keys()) == set(out["obs"].keys()) == {"rgb", "state", "task"}
    ctx = mp.get_context("forkserver")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        agent, _ = pool.submit(raw_libero_frames, "libero_spatial", 2, 3, SIZE, 2).result()
    assert obs["rgb"][0].float().std() > 10  # a scene, not a black frame
    np.testing.assert_array_equal(obs["rgb"][0].numpy(), agent[::-1, ::-1])


@pytest.mark.parametrize("policy", ["openvla_oft", "pi0"])
def test_a_policy_reading_wrist_rgb_is_refused_at_start_up_without_the_wrist_camera(policy):
    from m2flow.policies import PolicyError, policy_config, registry

    check = registry.policy_class(policy).check_config
    no_wrist = env_config(name="LIBERO/libero_spatial", obs_mode="rgb", wrist_camera=False)
    with pytest.raises(PolicyError, match=r"policy\.image_keys=\['rgb', 'wrist_rgb'\] reads "
                                          r"wrist_rgb, but env\.wrist_camera=false") as e:
        check(policy_config(name=policy), no_wrist)  # its default: both cameras
    assert "\n" not in str(e.value)
    check(policy_config(name=policy, image_keys=["rgb"]), no_wrist)
    check(policy_config(name=policy), env_config(name="LIBERO/libero_spatial", obs_mode="rgb"))


def plain_steps(env, seeds, tasks, actions):
    """Resets ``env`` and steps it one action at a time, every frame rendered: each step's
    result (the independent computation a chunk's frames are checked against)."""
    env.reset(seed=seeds, task=tasks)
    return [env.step(a) for a in actions.unbind(1)]


def test_a_chunks_inner_steps_skip_their_frames_and_change_nothing_else(rgb_env):
    from m2flow.envs.chunked import ChunkedEnv

    seeds, tasks = [4, 9], [2, 5]
    chunk = torch.from_numpy(np.random.RandomState(1).uniform(-0.5, 0.5, (2, 8, 7))).float()
    plain = plain_steps(rgb_env, seeds, tasks, chunk)
    # an inner step on its own: black frames, the same physics as the rendered step
    rgb_env.reset(seed=seeds, task=tasks)
    rgb_env.step_async(chunk[:, 0], frames=False)
    inner = rgb_env.step_wait()
    assert inner["obs", "rgb"].sum() == 0 and inner["obs", "wrist_rgb"].sum() == 0
    assert plain[0]["obs", "rgb"].float().std() > 10
    assert torch.equal(inner["obs", "state"], plain[0]["obs", "state"])
    # the whole chunk (7 steps without frames, the last with): what the policy acts on next
    # is the plain loop's last observation, to the pixel
    rgb_env.reset(seed=seeds, task=tasks)
    out = ChunkedEnv(rgb_env).step(chunk)
    for key in ("rgb", "wrist_rgb", "state"):
        assert torch.equal(out["obs", key], plain[-1]["obs", key]), key
        assert torch.equal(out["next", "obs", key], plain[-1]["next", "obs", key]), key
    assert torch.equal(out["next", "reward"], sum(p["next", "reward"] for p in plain))


def test_an_episode_that_times_out_inside_a_chunk_ends_on_its_rendered_frames():
    from m2flow.envs.chunked import ChunkedEnv

    env = make_env(env_config(name="LIBERO/libero_spatial", num_envs=1, obs_mode="rgb",
                              image_size=SIZE, settle_steps=0, max_episode_steps=3))
    try:
        chunk = torch.from_numpy(np.random.RandomState(2).uniform(-0.5, 0.5, (1, 5, 7))).float()
        plain = plain_steps(env, [6], [1], chunk)
        assert plain[2]["next", "truncated"].item()  # step 3 of 5 ends the episode
        env.reset(seed=[6], task=[1])
        out = ChunkedEnv(env).step(chunk)
        assert out["next", "truncated"].item() and out["next", "num_steps"].item() == 3
        final = out["next", "obs", "rgb"]  # the frames a critic bootstraps from
        assert final.float().std() > 10
        assert torch.equal(final, plain[2]["next", "obs", "rgb"])
        assert torch.equal(out["next", "obs", "wrist_rgb"], plain[2]["next", "obs", "wrist_rgb"])
        assert torch.equal(out["obs", "rgb"], plain[-1]["obs", "rgb"])  # the next episode's
    finally:
        env.close()


def test_the_same_seed_gives_the_same_scene(rgb_env):
    first = rgb_env.reset(seed=[7, 7], task=[3, 3])["obs"]
    # two processes, same task and seed: the same scene, to the pixel
    assert torch.equal(first["rgb"][0], first["rgb"][1])
    assert torch.equal(first["state"][0], first["state"][1])
    for _ in range(3):  # move away, then reset with the same seed again
        rgb_env.step(torch.tensor([[1, 0, 0, 0, 0, 0, 1]] * 2, dtype=torch.float32))
    again = rgb_env.reset(seed=[7, 7], task=[3, 3])["obs"]
    for key in ("rgb", "wrist_rgb", "state"):
        assert torch.equal(again[key], first[key]), key
    other = rgb_env.reset(seed=[8, 57], task=[3, 3])["obs"]
    assert not torch.equal(other["rgb"][0], first["rgb"][0])
    # seed 57 starts from init state 57 % 50 = 7, but places the fixtures its own way
    assert not torch.equal(other["rgb"][1], first["rgb"][1])
    assert torch.equal(other["state"][1], first["state"][1])


def test_a_trajectory_matches_the_one_recorded_under_mujoco_3_3_7():
    """robosuite 1.4.0 on the installed MuJoCo (3.11, through ``robosuite_on_new_mujoco``)
    against the record from MuJoCo 3.3.7, same actions:

    - the arm (Panda: 7 joints and 2 fingers, qpos[:9]) moves the same to 1e-7 (measured:
      7e-9, after moving up to 0.46 rad);
    - the objects, which drop ~6 cm onto the table in the first steps, land within 2 mm
      (measured: 1.4 mm mid-fall, at step 2) and from step 10 on stay within 0.1 mm
      (measured: 0.015 mm): contact resolution changed between the versions, not the scene;
    - frames within 16 of 255 per channel value and 0.05 on average (measured: 7 at most, on
      about 0.1 % of the values).
    """
    ref = np.load(RECORD)
    assert str(ref["mujoco"]) == "3.3.7"
    ctx = mp.get_context("forkserver")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        now = pool.submit(libero_trajectory, len(ref["qpos"])).result()
    arm = slice(0, 9)
    assert np.abs(ref["qpos"][-1, arm] - ref["qpos"][0, arm]).max() > 0.3  # the arm moves
    np.testing.assert_allclose(now["qpos"][:, arm], ref["qpos"][:, arm], rtol=0, atol=1e-7)
    np.testing.assert_allclose(now["qpos"], ref["qpos"], rtol=0, atol=2e-3)
    np.testing.assert_allclose(now["qpos"][10:], ref["qpos"][10:], rtol=0, atol=1e-4)
    np.testing.assert_array_equal(now["rewards"], ref["rewards"])
    for key in ("first", "last"):
        diff = np.abs(now[key].astype(int) - ref[key].astype(int))
        assert diff.max() <= 16 and diff.mean() <= 0.05, (key, diff.max(), diff.mean())


# -- config errors (raised before any simulator process starts) -------------------------
def make(name="LIBERO/libero_spatial", **kw):
    return make_env(env_config(name=name, num_envs=1, **kw))


def test_unknown_suite_suggests_the_right_one():
    with pytest.raises(EnvError, match=r"env\.name='LIBERO/libero_spatail'.*"
                                       r"Did you mean 'libero_spatial'\?"):
        make("LIBERO/libero_spatail")


@pytest.mark.parametrize("kw, field", [
    ({"foo": 1}, r"env 'LIBERO/libero_spatial' has no setting 'foo'\..* task_ids, gl"),
    ({"render_quality": "ultra"}, r"env\.render_quality='ultra'"),
    ({"gl": "glfw"}, r"env\.gl='glfw'"),
    ({"task_ids": [3, 10]}, r"env\.task_ids=\[3, 10\]: .* tasks 0-9"),
    ({"task_ids": []}, r"env\.task_ids=\[\]"),
    ({"obs_mode": "depth"}, r"env\.obs_mode='depth'"),
    ({"reward_mode": "dense"}, r"env\.reward_mode='dense'"),
])
def test_bad_config_names_the_field(kw, field):
    with pytest.raises(EnvError, match=field):
        make(**kw)


def test_assets_path_without_scenes_is_an_env_error(tmp_path):
    (tmp_path / "textures").mkdir()
    with pytest.raises(EnvError, match=r"env\.assets_path=.* has no scenes/ folder"):
        make(assets_path=str(tmp_path))


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] != ["record"] or len(sys.argv) != 3:
        sys.exit("usage: python -m tests.envs.test_libero record PATH.npz")
    np.savez_compressed(sys.argv[2], **libero_trajectory())
