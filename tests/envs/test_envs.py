"""Registry sweep and the batched-env contract, on real simulators."""

import numpy as np
import pytest
import torch

from m2flow.envs import (
    EnvError,
    env_class,
    env_config,
    make_env,
    register_env,
    registered_envs,
)
from m2flow.envs.gymnasium_env import GymnasiumEnv


def concrete_ids():
    ids = []
    for name in registered_envs():
        ids += list(getattr(env_class(name), "EXAMPLE_IDS", ())) if name.endswith("/*") else [name]
    return ids


@pytest.mark.parametrize("env_id", concrete_ids())
def test_every_registered_env_steps_a_batch(env_id):
    env = make_env(env_config(name=env_id, num_envs=2))
    try:
        obs = env.reset(seed=[0, 1])["obs"]
        assert set(obs.keys()) == set(env.spec.obs_shapes)
        for _ in range(5):
            out = env.step(torch.rand(2, env.spec.action_dim) * 2 - 1)
        assert out.batch_size == torch.Size([2])
        for key, shape in env.spec.obs_shapes.items():
            assert out["obs", key].shape == (2, *shape)
            assert out["next", "obs", key].shape == (2, *shape)
        assert out["next", "reward"].dtype == torch.float32
        for flag in ("terminated", "truncated", "done", "success"):
            assert out["next", flag].dtype == torch.bool and out["next", flag].shape == (2,)
        assert out.device in (None, torch.device("cpu"))
    finally:
        env.close()


def test_auto_reset_hands_back_final_and_first_observation():
    env = make_env(env_config(name="gym/Pendulum-v1", num_envs=2, max_episode_steps=3))
    env.reset(seed=[0, 1])
    outs = [env.step(torch.zeros(2, 1)) for _ in range(3)]
    last = outs[-1]
    assert last["next", "truncated"].all() and last["next", "done"].all()
    assert not last["next", "terminated"].any()
    # the final obs continues the episode; the root obs is a fresh start
    assert not torch.equal(last["next", "obs", "state"], last["obs", "state"])
    assert torch.equal(outs[1]["obs", "state"], outs[1]["next", "obs", "state"])


def test_same_seeds_give_the_same_rollout():
    def run():
        env = make_env(env_config(name="gym/Pendulum-v1", num_envs=2))
        env.reset(seed=[3, 4])
        return env.step(torch.ones(2, 1))["next", "obs", "state"]

    assert torch.equal(run(), run())


def test_unknown_env_lists_registered_names():
    with pytest.raises(EnvError, match=r"Unknown env 'Nope/Task-v1'. Known: .*ManiSkill/\*"):
        make_env(env_config(name="Nope/Task-v1"))


def test_unknown_maniskill_task_suggests_the_closest():
    with pytest.raises(EnvError, match="Did you mean 'PushCube-v1'"):
        make_env(env_config(name="ManiSkill/PushCub-v1"))


def test_maniskill_task_with_missing_assets_says_how_to_get_them():
    with pytest.raises(EnvError, match="download_asset"):
        make_env(env_config(name="ManiSkill/PickSingleYCB-v1"))


def test_obs_mode_the_adapter_cannot_render_is_rejected():
    with pytest.raises(EnvError, match="obs_mode='depth'"):
        make_env(env_config(name="ManiSkill/PushCube-v1", obs_mode="depth"))


def test_register_twice_needs_override():
    register_env("Test/Twice-v1", GymnasiumEnv)
    with pytest.raises(EnvError, match="override=True"):
        register_env("Test/Twice-v1", "some.module:Other")
    register_env("Test/Twice-v1", "some.module:Other", override=True)
    assert "Test/Twice-v1" in registered_envs()


def test_decorator_registration_is_found_by_make_env():
    @register_env("Test/Pendulum-v1", override=True)
    class Pendulum(GymnasiumEnv):
        def __init__(self, cfg, device="cpu"):
            cfg.name = "gym/Pendulum-v1"
            super().__init__(cfg, device)

    env = make_env(env_config(name="Test/Pendulum-v1", num_envs=2))
    assert isinstance(env, Pendulum) and env.spec.action_dim == 1


def test_maniskill_rgb_observations_render_on_this_machine():
    env = make_env(env_config(name="ManiSkill/PushCube-v1", num_envs=2, obs_mode="rgb",
                              image_size=32))
    try:
        obs = env.reset(seed=[0, 1])["obs"]
        assert obs["rgb"].shape == (2, 32, 32, 3) and obs["rgb"].dtype == torch.uint8
        assert obs["rgb"].float().std() > 0  # a real picture, not a blank frame
    finally:
        env.close()


def test_maniskill_privileged_state_is_the_simulators_state_now():
    """``env.privileged_state``: ("obs", "privileged") equals ManiSkill's own get_state() of an
    independent env given the same seed and actions, at the reset and after steps."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401

    cfg = env_config(name="ManiSkill/PushCube-v1", num_envs=2, obs_mode="rgb", image_size=32,
                     control_mode="pd_ee_delta_pos", privileged_state=True)
    env = make_env(cfg)
    ref = gym.make("PushCube-v1", num_envs=1, obs_mode="state", control_mode="pd_ee_delta_pos",
                   sim_backend="physx_cpu", render_backend="none")
    try:
        assert env.spec.obs_shapes["privileged"] == tuple(ref.unwrapped.get_state().shape[1:])
        obs = env.reset(seed=[7, 8])["obs"]
        ref.reset(seed=8)
        torch.testing.assert_close(obs["privileged"][1], ref.unwrapped.get_state()[0].float())
        cube = ref.unwrapped.obj.pose.p[0].float()  # the cube's position is in it
        assert any(torch.allclose(obs["privileged"][1][i:i + 3], cube)
                   for i in range(obs["privileged"].shape[1] - 2))
        action = torch.tensor([[0.0, 0.0, -1.0, 0.0], [0.5, -0.5, -1.0, 0.0]])
        for _ in range(3):
            out = env.step(action)
            ref.step(action[1:])
        moved = out["obs"]["privileged"][1]
        torch.testing.assert_close(moved, ref.unwrapped.get_state()[0].float(), atol=1e-4, rtol=0)
        assert (moved - obs["privileged"][1]).abs().max() > 1e-3  # the arm moved: not the reset's
    finally:
        env.close()
        ref.close()


def _push(ref, hold: bool) -> torch.Tensor:
    """A hand-written PushCube pusher (pd_ee_delta_pos): the closed gripper goes behind the
    cube and pushes it along +x towards the goal and, unless ``hold``, on past it; with
    ``hold`` it stops once the cube is well inside the goal region. Reads ``ref``'s state."""
    u = ref.unwrapped
    tcp, cube, goal = (x.pose.p[0].numpy() for x in (u.agent.tcp, u.obj, u.goal_region))
    behind = cube + np.array([-0.05, 0.0, 0.0])
    behind[2] = 0.02
    a = np.array([0.0, 0.0, 0.0, -1.0], dtype=np.float32)
    if hold and np.linalg.norm(cube[:2] - goal[:2]) < 0.07:
        return torch.from_numpy(a)
    if np.linalg.norm(tcp[1:] - behind[1:]) > 0.01 or tcp[0] > cube[0] - 0.035:
        d = behind - tcp
        if tcp[2] < 0.05 and abs(d[1]) > 0.02:  # over the cube, not through it
            d[2] = 0.06 - tcp[2]
        a[:3] = np.clip(d * 30, -1, 1)
    else:
        a[:3] = [1.0, np.clip((cube[1] - tcp[1]) * 30, -1, 1),
                 np.clip((0.02 - tcp[2]) * 30, -1, 1)]
    return torch.from_numpy(a)


def test_maniskill_success_flags_equal_maniskills_own_loop():
    """PushCube through m2flow's adapter (a process per env, auto-reset) and ManiSkill's own
    ``gym.make`` loop, same seeds, same hand-set actions: the same success flag at every step,
    and m2flow's count of the episodes (``RunningEpisodes``) equals ManiSkill's own
    ``success_once`` / ``success_at_end`` (``CPUGymWrapper(record_metrics=True)``). Env 0's
    pusher pushes the cube through the goal (seed 3: reached, then left), env 1's holds it."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    from m2flow.embodied.workers.episodes import RunningEpisodes

    steps, seeds, hold = 50, [3, 4], [False, True]
    kw = dict(control_mode="pd_ee_delta_pos", reward_mode="normalized_dense")
    env = make_env(env_config(name="ManiSkill/PushCube-v1", num_envs=2, ignore_terminations=True,
                              max_episode_steps=steps, **kw))
    refs = [CPUGymWrapper(gym.make("PushCube-v1", num_envs=1, obs_mode="state",
                                   max_episode_steps=steps, sim_backend="physx_cpu",
                                   render_backend="none", **kw),
                          ignore_terminations=True, record_metrics=True) for _ in seeds]
    try:
        env.reset(seed=seeds, rebuild=True)
        for ref, seed in zip(refs, seeds):
            ref.reset(seed=seed, options={"reconfigure": True})
        runs, flags = RunningEpisodes(2), []
        for _ in range(steps):
            action = torch.stack([_push(ref, h) for ref, h in zip(refs, hold)])
            out = env.step(action)
            results = [ref.step(a.numpy()) for ref, a in zip(refs, action)]
            infos = [r[4] for r in results]
            flags.append([bool(i["success"]) for i in infos])
            assert out["next", "success"].tolist() == flags[-1], f"step {len(flags)}"
            torch.testing.assert_close(out["next", "reward"],  # the same states
                                       torch.tensor([float(r[1]) for r in results]))
            ended = runs.update(out)
        assert out["next", "done"].all()
        assert ended.success_once == [bool(i["episode"]["success_once"]) for i in infos]
        assert ended.success_at_end == [bool(i["episode"]["success_at_end"]) for i in infos]
        assert ended.success_once == [True, True] and ended.success_at_end == [False, True]
    finally:
        env.close()
        for ref in refs:
            ref.close()


def test_privileged_state_beside_state_obs_is_one_line():
    cfg = env_config("ManiSkill/PushCube-v1", obs_mode="state", privileged_state=True)
    with pytest.raises(EnvError, match="env.privileged_state=true.*env.obs_mode=rgb"):
        env_class(cfg.name).check_config(cfg)


@pytest.mark.parametrize("name", ["gym/Pendulum-v1"])  # LIBERO, Meta-World have it
def test_privileged_state_is_no_setting_of_an_env_that_cannot_give_it(name):
    with pytest.raises(EnvError, match=f"env '{name}' has no setting 'privileged_state'"):
        env_config(name, privileged_state=True)


def test_gpu_physx_that_cannot_load_is_one_line_naming_the_library_and_the_fix(monkeypatch):
    """On the GPU machine without network (scripts/gpu_check.sh), SAPIEN's download of its GPU
    PhysX library failed with a requests traceback from inside the env worker."""
    import requests
    import sapien

    from m2flow.envs.base import EnvError
    from m2flow.envs.maniskill import enable_gpu_physx

    def offline():
        raise requests.ConnectionError("Failed to resolve 'github.com'")

    monkeypatch.setattr(sapien.physx, "enable_gpu", offline)
    with pytest.raises(EnvError) as e:
        enable_gpu_physx()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("env.sim_backend=gpu: ")
    assert "ConnectionError" in msg and f"/.sapien/physx/{sapien.physx.version()}" in msg
    assert "linux-so.zip" in msg and msg.endswith("or set env.sim_backend=cpu.")


def test_a_reset_after_a_grasp_observes_the_new_episodes_contacts():
    """PickCube's ``is_grasped`` is read from the contacts of the simulator's last step: an
    episode that ended holding the cube used to report it as 1 in the next episode's first
    observation. The env process's env (``_make_cpu_env``) after a grasp, reset to seed 3,
    against a newly built ManiSkill env reset to seed 3: the same observation (is_grasped 0),
    the same simulator state, and the same states over the next steps."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401
    import numpy as np
    import sapien
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    from m2flow.envs.maniskill import _make_cpu_env

    kw = dict(obs_mode="state", control_mode="pd_joint_delta_pos", render_backend="none")
    threads = torch.get_num_threads()
    env = _make_cpu_env("PickCube-v1", "state", True, kw)  # sets one thread (its process's)
    torch.set_num_threads(threads)
    fresh = CPUGymWrapper(gym.make("PickCube-v1", num_envs=1, sim_backend="physx_cpu", **kw),
                          ignore_terminations=True)
    grasped = 18  # PickCube's state: qpos (9), qvel (9), then is_grasped
    try:
        env.reset(seed=3)
        hold = np.zeros(8, dtype=np.float32)
        hold[7] = 1.0  # open the gripper, put the cube between its fingers, close it
        for _ in range(5):
            env.step(hold)
        base = env.unwrapped
        base.cube.set_pose(sapien.Pose(p=base.agent.tcp.pose.p[0].tolist()))
        hold[7] = -1.0
        for _ in range(15):
            obs = env.step(hold)[0]
        assert obs[grasped] == 1.0  # holding it
        obs = env.reset(seed=3)[0]
        want = fresh.reset(seed=3)[0]
        assert want[grasped] == 0.0
        np.testing.assert_allclose(obs, want, atol=1e-6)
        np.testing.assert_allclose(base.get_state().numpy(), fresh.unwrapped.get_state().numpy(),
                                   atol=1e-6)
        move = np.zeros(8, dtype=np.float32)
        move[0] = 0.5
        for _ in range(5):
            np.testing.assert_allclose(env.step(move)[0], fresh.step(move)[0], atol=1e-5)
    finally:
        env.close()
        fresh.close()
